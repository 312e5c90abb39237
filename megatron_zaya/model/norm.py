"""RMSNorm and ZAYA1's residual scaling as modules (docs/architecture.md §1-§2); the math is ops/residual_norm.py.

``RMSNorm`` follows the reference numerics: statistics in fp32, the normalised value cast back to the input
dtype, then scaled by the weight. Unlike Megatron's ``WrappedTorchNorm`` it supports sequence parallelism
(its weight is marked so that Megatron all-reduces its gradient across tensor-parallel ranks), which MoE
with TP needs when neither Transformer Engine nor apex is installed.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import residual_norm
from ..ops.residual_norm import rms_norm


def residual_dtype(config) -> torch.dtype:
    """fp32 when ``fp32_residual_connection`` (ZAYA1's ``residual_in_fp32``), else the parameter dtype."""
    return torch.float32 if config.fp32_residual_connection else config.params_dtype


def _vector(config, value: float) -> nn.Parameter:
    """A per-channel [hidden] parameter; under sequence parallelism its gradient is summed over TP ranks."""
    param = nn.Parameter(torch.full((config.hidden_size,), value, dtype=config.params_dtype))
    param.sequence_parallel = bool(config.sequence_parallel)
    return param


class RMSNorm(nn.Module):
    """Megatron ``LayerNormBuilder``-compatible RMSNorm: ``RMSNorm(config=, hidden_size=, eps=)``.

    Each norm of the residual stream is a call of this module (with the residual merge folded in where a
    :class:`ResidualScaling` calls it), never a read of its weight from outside: hooks on a module run only when
    it is called, and Megatron's DDP waits for ``--overlap-param-gather``'s all-gather of a weight in one.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)
        self.ops = residual_norm.choose(config)

    def forward(self, x: torch.Tensor, dtype: torch.dtype | None = None, merge: ResidualScaling | None = None,
                hidden: torch.Tensor | None = None):
        """``x`` normalised. With ``dtype``, ``x`` is the residual stream and a sublayer's input in ``dtype`` is
        returned; with ``merge`` too, ``hidden`` (a sublayer's output) is first merged into the stream, in one
        pass where the kernel is chosen: -> (the next sublayer's input, the new stream)."""
        if merge is not None:
            return self.ops.merge_and_norm(hidden, x, *merge.vectors, self.weight, self.eps, dtype,
                                           merge.residual_dtype)
        if dtype is not None:
            return self.ops.norm(x, self.weight, self.eps, dtype)
        return rms_norm(x, self.weight, self.eps)


class ResidualScaling(nn.Module):
    """Merge a sublayer output into the fp32 residual stream: ``(h + β_h) ⊙ α_h + (r + β_r) ⊙ α_r``.

    Sits in a ``TransformerLayer``'s ``self_attn_bda`` / ``mlp_bda`` slot (the slot that combines a sublayer's
    output with the residual). The affine is applied as written in all reference code, not as the
    ``α ⊙ x + β`` of the paper's prose (§2). Init α = 1, β = 0, i.e. a plain residual add.
    """

    def __init__(self, config):
        super().__init__()
        self.residual_dtype = residual_dtype(config)
        self.hidden_states_scale = _vector(config, 1.0)
        self.hidden_states_bias = _vector(config, 0.0)
        self.residual_scale = _vector(config, 1.0)
        self.residual_bias = _vector(config, 0.0)
        self.merge = residual_norm.choose(config).merge

    @property
    def vectors(self) -> tuple[torch.Tensor, ...]:
        """The merge's parameters in ``ops.residual_norm``'s order: β_h, α_h, β_r, α_r."""
        return self.hidden_states_bias, self.hidden_states_scale, self.residual_bias, self.residual_scale

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor, norm: RMSNorm | None = None,
                dtype: torch.dtype | None = None):
        """The new residual stream; with ``norm``, also the next sublayer's input in ``dtype``, merged and
        normalised by one call of ``norm`` -> (input, stream)."""
        if norm is not None:
            return norm(residual, dtype, merge=self, hidden=hidden_states)
        return self.merge(hidden_states, residual, *self.vectors, dtype=self.residual_dtype)


class ResidualAdd(nn.Module):
    """The plain residual add, for configs with ``residual_scaling=False``."""

    def __init__(self, config):
        super().__init__()
        self.residual_dtype = residual_dtype(config)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor, norm: RMSNorm | None = None,
                dtype: torch.dtype | None = None):
        """As :meth:`ResidualScaling.forward`."""
        residual = hidden_states.to(self.residual_dtype) + residual.to(self.residual_dtype)
        return residual if norm is None else (norm(residual, dtype), residual)


class InputScaling(nn.Module):
    """The affine after the embedding, ``(e + b) ⊙ s``, which also moves the stream to the residual dtype."""

    def __init__(self, config):
        super().__init__()
        self.residual_dtype = residual_dtype(config)
        self.scale = _vector(config, 1.0)
        self.bias = _vector(config, 0.0)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return ((embeddings + self.bias) * self.scale).to(self.residual_dtype)
