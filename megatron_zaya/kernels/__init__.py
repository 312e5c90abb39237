"""Triton kernels for ZAYA1 (CUDA and ROCm), each beside its plain-torch reference.

Every module exposes ``<op>(...)`` (the Triton kernel, forward and backward, falling back to the reference
off-GPU) and ``<op>_reference(...)`` with the same signature. Where the model computes the op itself, the
reference is the model's function, imported from ``megatron_zaya/model/`` (the router, the norms, the residual
merge, the CCA convolutions); the model picks the kernel or its reference when it is built (``ZayaConfig.kernels``).

* ``residual_rmsnorm``: ``residual_rms_norm`` (ZAYA residual scaling + RMSNorm), ``rms_norm``, ``TritonRMSNorm``
* ``swiglu``: ``swiglu`` (packed gate|up, optional per-token weights / bias)
* ``router``: ``route_head`` (EDA, RMSNorm, router MLP and top-1 in one kernel each way), ``route_top1``
  (softmax, biased top-1, gate, MoD skip class, expert counts), ``router_projection``
* ``cross_entropy``: ``cross_entropy``, ``linear_cross_entropy`` (LM head + loss without [T, V] logits)
* ``cca``: ``cca_qk`` (CCA convolutions + skip terms + QK norm + temperature + partial RoPE)
* ``grouped_gemm``: ``grouped_gemm`` (top-1 experts, tokens sorted by expert)
* ``newton_schulz``: ``newton_schulz`` (Muon's orthogonalisation: symmetric Gram kernels, CUDA-graph replays)

``megatron_zaya/patches/kernels.py`` swaps SwiGLU, the cross-entropy and the weight-gradient accumulation in for
Megatron-Core's own; ``testing.py`` runs the kernels on CPU for the tests.
"""
