"""Triton kernels for ZAYA1 (CUDA and ROCm), forward and backward. Triton only: each op's torch reference, the
fallback where a kernel cannot run and the choice between them live in ``megatron_zaya/ops``, which imports
these modules when a kernel is chosen. A kernel module imports nothing of the package but ``utils.py`` and
``launch.py`` (each launch through a cache of the compiled kernels, for less host time than ``kernel[grid]``).

Each module's ``runs_on(*tensors)`` says whether its kernels run on the tensors (on a GPU, or interpreted
under ``TRITON_INTERPRET=1``).

* ``residual_rmsnorm``: ``residual_rms_norm`` (ZAYA residual scaling + RMSNorm), ``residual_norm``,
  ``residual_merge``, ``rms_norm``
* ``swiglu``: ``swiglu`` (packed gate|up, optional per-token weights / bias)
* ``router``: ``route_head`` (EDA, RMSNorm, router MLP and top-1 in one kernel each way), ``route_top1``
  (softmax, biased top-1, gate, MoD skip class, expert counts), ``router_projection``
* ``cross_entropy``: ``cross_entropy``, ``linear_cross_entropy`` (LM head + loss without [T, V] logits)
* ``cca``: ``cca_qk`` (CCA convolutions + skip terms + QK norm + temperature + partial RoPE)
* ``grouped_gemm``: ``grouped_gemm`` (top-1 experts, tokens sorted by expert)
* ``newton_schulz``: ``gram`` (the symmetric products of Muon's Newton–Schulz, one triangle of tiles mirrored)

``megatron_zaya/patches/kernels.py`` swaps SwiGLU, the cross-entropy and the weight-gradient accumulation in for
Megatron-Core's own.
"""
