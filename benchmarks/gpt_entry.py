"""Megatron's GPT baseline as the benchmarks run it: ``benchmarks/gpt_pretrain.py`` with RMSNorm on the Triton kernel.

    python -m benchmarks.probe -m benchmarks.gpt_entry GPT_FLAGS

Without Transformer Engine or apex, Megatron's local specs build every norm through ``WrappedTorchNorm``, i.e.
``torch.nn.RMSNorm``: unfused eager math (~300 GB/s effective on an H200). ZAYA1's own model uses the Triton
RMSNorm, so the baseline gets it too, for a fair comparison: :func:`use_triton_rmsnorm` replaces
``megatron.core.models.backends.WrappedTorchNorm`` and the ``LNImpl`` globals of ``backends`` and
``gpt_layer_specs`` (where they are ``WrappedTorchNorm``, i.e. apex is absent) by a factory that builds
``TritonRMSNorm`` for RMSNorm (one read and one write per element, sequence parallelism supported, the same
checkpoint layout) and Megatron's norm otherwise. It is benchmark-only: the library never applies it. Off: run
``benchmarks/gpt_pretrain.py`` instead (GPUs only; on CPU the entry runs as it is).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import torch

ENTRY = Path(__file__).resolve().with_name("gpt_pretrain.py")


class TritonOrTorchNorm:
    """Megatron's ``WrappedTorchNorm`` with RMSNorm built as ``TritonRMSNorm`` (LayerNorm/L2Norm unchanged)."""

    torch_norm = None  # the WrappedTorchNorm replaced

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        if config.normalization == "RMSNorm":
            from megatron_zaya.ops.residual_norm import TritonRMSNorm

            return TritonRMSNorm(config, hidden_size, eps)
        return cls.torch_norm(config, hidden_size, eps, **kwargs)


def use_triton_rmsnorm() -> None:
    """Build RMSNorm in Megatron's local specs as ``TritonRMSNorm`` (see the module docstring)."""
    from megatron.core.models import backends
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_zaya.patches.registry import replace_attr

    TritonOrTorchNorm.torch_norm = backends.WrappedTorchNorm
    replace_attr(backends, "WrappedTorchNorm", TritonOrTorchNorm)
    for module in (backends, gpt_layer_specs):
        if module.LNImpl is TritonOrTorchNorm.torch_norm:
            replace_attr(module, "LNImpl", TritonOrTorchNorm)


if __name__ == "__main__":
    if torch.cuda.is_available():
        use_triton_rmsnorm()
    sys.argv[0] = str(ENTRY)
    runpy.run_path(str(ENTRY), run_name="__main__")
