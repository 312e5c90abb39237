"""Launch helpers shared by the Triton kernels: when a kernel can run, and how big to make its blocks.

A kernel runs on GPU tensors (CUDA or ROCm, both appear as ``tensor.is_cuda``); ``ops/`` falls back to the
torch reference elsewhere, so the same model code runs on the CPU test machine. Under ``TRITON_INTERPRET=1``
(set before the kernel module is imported: triton chooses interpreter vs compiler when ``@triton.jit`` runs)
the kernels also run on CPU tensors, which is how the unit tests exercise them.
"""

from __future__ import annotations

import functools
import warnings

import torch
import triton
import triton.language as tl
from triton.runtime import JITFunction


def is_interpreted(kernel) -> bool:
    """True when ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (runs on CPU tensors, in numpy): triton
    then makes an interpreted function instead of a ``JITFunction``. (A module loaded against a private copy of
    triton, as the tests do, loads this one with it, so the class is that copy's.)"""
    return not isinstance(kernel, JITFunction)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch grids: ``triton.cdiv`` is a ``constexpr_function`` in newer triton, ~1 µs a call
    on the host, and an eager layer step makes ~80 such calls."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n`` <= 1); ``triton.next_power_of_2`` without its host cost."""
    return 1 << max(0, n - 1).bit_length()


def triton_runs(kernel, *tensors: torch.Tensor) -> bool:
    """Whether ``kernel`` can run on ``tensors``: all on a GPU, or the kernel is interpreted."""
    return is_interpreted(kernel) or all(t.is_cuda for t in tensors)


@functools.cache
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def platform(device: torch.device) -> str:
    """``cuda``, ``rocm`` or ``cpu`` (interpreted kernels): the key of the per-platform launch tables."""
    if device.type != "cuda":
        return "cpu"
    return "rocm" if torch.version.hip else "cuda"


def persistent_programs(device: torch.device, work_items: int, per_multiprocessor: int = 2) -> int:
    """Grid size for a kernel whose programs loop over ``work_items``: a few per SM/CU, never more than items."""
    if device.type == "cuda":
        slots = per_multiprocessor * _multiprocessor_count(device.index if device.index is not None else 0)
    else:  # the interpreter runs programs one after another; a few exercise the striding loop
        slots = 3
    return max(1, min(work_items, slots))


def row_block(n_cols: int, max_cols: int, what: str) -> tuple[int, int]:
    """(BLOCK, num_warps) for a kernel that holds one row of ``n_cols`` in registers."""
    if n_cols > max_cols:
        raise ValueError(
            f"{what}: rows of {n_cols} elements exceed the {max_cols} this kernel keeps in registers; "
            "its torch reference in megatron_zaya/ops takes such shapes"
        )
    block = next_power_of_2(n_cols)
    return block, min(16, max(1, block // 256))


def flat_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., D] as a contiguous [rows, D] view (a copy only when ``x`` is not contiguous)."""
    return x.contiguous().view(-1, x.shape[-1])


#: ``enabled``: kernels that compute parameters' gradients add them straight into the parameters' ``main_grad``
#: (Megatron DDP's gradient buffer) where each has one, instead of returning them for DDP's hooks to add one
#: launch per parameter (the experts' fp32 accumulation also skips a rounding to bf16). Off while gradients must
#: be computed without being added (CUDA-graph warm-up: ``ops.experts.main_grad_untouched``).
ACCUMULATE_INTO_MAIN_GRAD = {"enabled": True}


def main_grad_targets(params) -> list[torch.Tensor] | None:
    """Each of ``params``' ``main_grad`` where adding into it is enabled and every one has a contiguous
    ``main_grad`` of its shape, kept by Megatron's DDP (which marks such a parameter ``grad_added_to_main_grad``);
    else None (return the gradients)."""
    if not ACCUMULATE_INTO_MAIN_GRAD["enabled"]:
        return None
    targets = [getattr(p, "main_grad", None) for p in params]
    if any(t is None or t.shape != p.shape or not t.is_contiguous() or not hasattr(p, "grad_added_to_main_grad")
           for t, p in zip(targets, params)):
        return None
    return targets


#: ``needed``: False while the backward of a composite op whose parameters are off autograd's graph runs: nothing
#: reads a gradient that a kernel added into ``main_grad`` (``ops.composite.hand_to_ddp``), so kernels return None
#: for it instead of a placeholder tensor (``ops.composite.placeholders_unread``).
GRADIENT_PLACEHOLDERS = {"needed": True}


def added_to_main_grad(params) -> list[torch.Tensor | None]:
    """Mark ``params`` as having their gradients in ``main_grad`` (DDP's hooks then add nothing) and return a
    placeholder gradient for each: an unwritten tensor of its shape that autograd hands to the hook, which fires on
    any gradient and drops it (autograd takes a contiguous placeholder as it is, without a copy); None for each
    where no placeholder is needed (``GRADIENT_PLACEHOLDERS``)."""
    for param in params:
        param.grad_added_to_main_grad = True
    if not GRADIENT_PLACEHOLDERS["needed"]:
        return [None] * len(params)
    return [torch.empty_like(param) for param in params]


_FP32_OUT_GEMM = {"supported": True}


def matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` accumulated and returned in fp32 without upcasting bf16/fp16 inputs (vendor GEMM).

    The products of bf16 values are exact in fp32, so this equals an fp32 matmul of the upcast inputs up to
    summation order, at the bf16 GEMM's speed (696 vs 50 TFLOP/s on an H200) and without fp32 copies.
    """
    if a.dtype == torch.float32 or not a.is_cuda:
        return a.float() @ b.float()
    if _FP32_OUT_GEMM["supported"]:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, NotImplementedError) as error:  # e.g. a ROCm build without the dtype overload
            _FP32_OUT_GEMM["supported"] = False
            warnings.warn(f"torch.mm(out_dtype=float32) unavailable ({error}); fp32-output GEMMs upcast to fp32")
    return a.float() @ b.float()


def matmul_fp32_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool = False) -> None:
    """``out (+)= a @ b``, the product summed in fp32, into an fp32 ``out`` without an fp32 temporary where the
    vendor GEMM allows. An ``out`` in the inputs' dtype (a bf16 ``main_grad``) takes one GEMM whose epilogue adds
    ``out`` in fp32 and rounds once, as Megatron's bf16 gradient-accumulation fusion does."""
    if accumulate and out.dtype == a.dtype == b.dtype:
        out.addmm_(a, b)
        return
    if a.is_cuda and a.dtype != torch.float32 and _FP32_OUT_GEMM["supported"]:
        try:
            if accumulate:
                torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
            else:
                torch.mm(a, b, out_dtype=torch.float32, out=out)
            return
        except (RuntimeError, NotImplementedError, TypeError):  # no fp32-output overload: one temporary
            pass
    if accumulate:
        out += matmul_fp32(a, b)
    else:
        out.copy_(matmul_fp32(a, b))


@triton.jit
def column_sums(partials_ptr, rows, row_length, cols, BLOCK_R: tl.constexpr):
    """Sums over ``rows`` rows of fp32 partials [rows, row_length] at columns ``cols``, in a fixed order (the
    same bits on every run, no atomics); columns past a row's end sum to 0."""
    total = tl.zeros(cols.shape, tl.float32)
    for first in range(0, rows, BLOCK_R):
        row = tl.cast(first + tl.arange(0, BLOCK_R), tl.int64)
        mask = (row < rows)[:, None] & (cols < row_length)[None, :]
        total += tl.sum(tl.load(partials_ptr + row[:, None] * row_length + cols[None, :], mask=mask, other=0.0), 0)
    return total


@triton.jit
def store_sum(out_ptrs, total, mask, ACCUMULATE: tl.constexpr):
    """out (+)= total, cast on store: a parameter's gradient, or added into its fp32 main_grad."""
    if ACCUMULATE:
        total += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=mask)
