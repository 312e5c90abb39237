"""RMSNorm and ZAYA1's residual merge (docs/architecture.md §1-§2); kernel op ``residual``.

The merge folds a sublayer's output ``h`` into the residual stream ``r`` with two learned per-channel affines,
``(h + β_h) ⊙ α_h + (r + β_r) ⊙ α_r``, and the next sublayer reads ``RMSNorm(r)`` in the model dtype. RMSNorm
keeps its statistics in fp32 and casts the normalised value back before the weight (transformers' ZayaRMSNorm).
The kernel (``kernels/residual_rmsnorm.py``) does the merge and the norm in one pass each way on the fp32 stream.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` with the statistics in fp32; ``x`` [..., D]."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def residual_merge(hidden, residual, hidden_bias, hidden_scale, residual_bias, residual_scale,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The merge ``(h + β_h) ⊙ α_h + (r + β_r) ⊙ α_r``, computed and returned in ``dtype``."""
    h = (hidden.to(dtype) + hidden_bias.to(dtype)) * hidden_scale.to(dtype)
    return h + (residual.to(dtype) + residual_bias.to(dtype)) * residual_scale.to(dtype)


def residual_norm(residual: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype | None = None):
    """RMSNorm of the residual stream as a layer reads it: ``rms_norm(residual.to(dtype), weight, eps)``;
    ``dtype`` defaults to the weight's."""
    return rms_norm(residual.to(dtype or weight.dtype), weight, eps)


def residual_rms_norm(hidden, residual, hidden_bias, hidden_scale, residual_bias, residual_scale, weight, eps: float,
                      dtype: torch.dtype | None = None, residual_dtype: torch.dtype = torch.float32):
    """The merge in ``residual_dtype``, then :func:`residual_norm` of it: -> (normed in ``dtype``, new residual)."""
    new_residual = residual_merge(hidden, residual, hidden_bias, hidden_scale, residual_bias, residual_scale,
                                  residual_dtype)
    return residual_norm(new_residual, weight, eps, dtype), new_residual


# ----------------------------------------------------------------------------------------- the Triton kernel


def _kernel():
    from ..kernels import residual_rmsnorm  # imported when first called: triton only where a kernel is chosen

    return residual_rmsnorm


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm` by the Triton kernel where it runs (GPU tensors, or interpreted), else the reference."""
    kernel = _kernel()
    return kernel.rms_norm(x, weight, eps) if kernel.runs_on(x, weight) else rms_norm(x, weight, eps)


def fused_residual_merge(hidden, residual, hidden_bias, hidden_scale, residual_bias, residual_scale,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`residual_merge` (fp32) by the Triton kernel where it runs."""
    kernel, args = _kernel(), (hidden, residual, hidden_bias, hidden_scale, residual_bias, residual_scale)
    return kernel.residual_merge(*args) if kernel.runs_on(*args) else residual_merge(*args, dtype=dtype)


def fused_residual_norm(residual, weight, eps: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`residual_norm` in the weight's dtype by the Triton kernel where it runs, the cast folded in."""
    kernel = _kernel()
    if kernel.runs_on(residual, weight):
        return kernel.residual_norm(residual, weight, eps)
    return residual_norm(residual, weight, eps, dtype)


def fused_residual_rms_norm(hidden, residual, hidden_bias, hidden_scale, residual_bias, residual_scale, weight,
                            eps: float, dtype: torch.dtype | None = None, residual_dtype: torch.dtype = torch.float32):
    """:func:`residual_rms_norm` (an fp32 stream) as one Triton pass each way where the kernel runs."""
    kernel, args = _kernel(), (hidden, residual, hidden_bias, hidden_scale, residual_bias, residual_scale, weight)
    if kernel.runs_on(*args):
        return kernel.residual_rms_norm(*args, eps)
    return residual_rms_norm(*args, eps, dtype, residual_dtype)


# ----------------------------------------------------------------------------------------- the choice


class ResidualNormOps(NamedTuple):
    """The functions a layer calls: ``merge``, ``norm`` (:func:`residual_norm`), ``merge_and_norm``."""

    merge: Callable
    norm: Callable
    merge_and_norm: Callable


REFERENCE = ResidualNormOps(residual_merge, residual_norm, residual_rms_norm)
FUSED = ResidualNormOps(fused_residual_merge, fused_residual_norm, fused_residual_rms_norm)


def choose(config) -> ResidualNormOps:
    """The kernels with the ``residual`` op on an fp32 residual stream (what they are written for), else the
    references."""
    fp32_stream = config.fp32_residual_connection or config.params_dtype == torch.float32
    return FUSED if config.uses_kernel("residual") and fp32_stream else REFERENCE


class TritonRMSNorm(torch.nn.Module):
    """RMSNorm module on the Triton kernel, built like a Megatron norm: ``TritonRMSNorm(config, hidden_size, eps)``.

    Fits Megatron's ``LayerNormBuilder`` protocol (input_layernorm, pre_mlp_layernorm, the block's final
    norm, q/k layernorms); checkpoint layout is a single ``weight`` [hidden_size], as torch.nn.RMSNorm's.
    Unlike Megatron's torch fallback it supports sequence parallelism (marks the weight for the SP grad
    all-reduce).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused_megatron_kwargs):
        super().__init__()
        if getattr(config, "layernorm_zero_centered_gamma", False):
            raise ValueError("TritonRMSNorm has no zero-centered gamma; unset --apply-layernorm-1p")
        if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise ValueError(f"TritonRMSNorm is an RMSNorm but config.normalization is {config.normalization!r}")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
