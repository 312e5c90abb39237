"""Triton kernels for ZAYA1 (CUDA and ROCm), each with its plain-torch reference in the same module.

Every module exposes ``<op>(...)`` (the Triton kernel, forward and backward, falling back to the reference
off-GPU) and ``<op>_reference(...)`` with the same signature:

* ``residual_rmsnorm``: ``residual_rms_norm`` (ZAYA residual scaling + RMSNorm), ``rms_norm``, ``TritonRMSNorm``
* ``swiglu``: ``swiglu`` (packed gate|up, optional per-token weights / bias)
* ``router``: ``route_top1`` (softmax, biased top-1, gate, MoD skip class, expert counts)
* ``cross_entropy``: ``cross_entropy``, ``linear_cross_entropy`` (LM head + loss without [T, V] logits)
* ``cca``: ``cca_qk`` (CCA convolutions + skip terms + QK norm + temperature + partial RoPE), ``value_time_delay``
* ``grouped_gemm``: ``grouped_gemm`` (top-1 experts, tokens sorted by expert)

``patches/kernels.py`` swaps some of them in for Megatron-Core defaults; ``testing.py`` runs them on CPU.
"""
