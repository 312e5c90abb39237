"""SwiGLU on the packed [gate ‖ up] fc1 output, optionally scaled per token (Triton, forward and backward).

ZAYA1's experts store fc1 as one [2F, D] matrix, first F rows = gate, last F = up (docs/architecture.md
§4.6), so the activation reads x [..., 2F] and writes silu(gate) * up [..., F]. The optional per-token
``weights`` [..., 1] is Megatron's ``weighted_bias_swiglu`` (the router probability applied inside the
expert); the optional ``bias`` [2F] is Megatron's ``bias_swiglu``. Math in fp32, output in x's dtype.
One read of x and one write per element each way; the backward recomputes silu from x. The torch reference,
the fallback and the choice live in ``ops/experts.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch
from .utils import cdiv, flat_rows, next_power_of_2, platform, triton_runs

#: Launch settings per platform (``benchmarks/tune_launch.py --kernel swiglu``): each program takes ``rows``
#: rows by at most ``block`` output columns with ``warps`` warps; ``backward_*`` the same for the backward kernel.
SWIGLU_TUNING = {  # H200: no setting of a 36-point sweep was 2% faster than this one (2026-11-30)
    "cuda": {"block": 4096, "rows": 1, "warps": 8, "backward_block": 4096, "backward_rows": 1, "backward_warps": 8},
    "rocm": {"block": 4096, "rows": 1, "warps": 8,  # not tuned: the CUDA row
             "backward_block": 4096, "backward_rows": 1, "backward_warps": 8},
    "cpu": {"block": 16, "rows": 2, "warps": 4,  # the interpreter: several column blocks and a partial row tile
            "backward_block": 16, "backward_rows": 2, "backward_warps": 4},
}  # fmt: skip


@triton.jit
def _tile(n_rows, n_cols, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's row indices [ROWS] (int64), column indices [BLOCK] and the [ROWS, BLOCK] bounds mask."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    return rows, cols, (rows < n_rows)[:, None] & (cols < n_cols)[None, :]


@triton.jit
def _load_gate_up(x_ptr, bias_ptr, rows, cols, mask, n_cols):
    """The packed [gate ‖ up] input at ``rows`` x ``cols``, plus the bias if any, in fp32."""
    x_tile = x_ptr + rows[:, None] * 2 * n_cols + cols[None, :]
    gate = tl.load(x_tile, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_tile + n_cols, mask=mask, other=0.0).to(tl.float32)
    if bias_ptr is not None:
        col_mask = cols < n_cols
        gate += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias_ptr + n_cols + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return gate, up


@triton.jit
def _swiglu_forward_kernel(
    x_ptr,  # [T, 2F]
    bias_ptr,  # [2F] or None
    weights_ptr,  # [T] or None
    out_ptr,  # [T, F]
    n_rows,  # T
    n_cols,  # F
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows, cols, mask = _tile(n_rows, n_cols, ROWS, BLOCK)
    gate, up = _load_gate_up(x_ptr, bias_ptr, rows, cols, mask, n_cols)
    out = gate * tl.sigmoid(gate) * up
    if weights_ptr is not None:
        out *= tl.load(weights_ptr + rows, mask=rows < n_rows, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(
    grad_out_ptr,  # [T, F]
    x_ptr,  # [T, 2F]
    bias_ptr,  # [2F] or None
    weights_ptr,  # [T] or None
    grad_x_ptr,  # [T, 2F]
    grad_weights_ptr,  # [T, column blocks] fp32 partial sums, or None
    n_rows,
    n_cols,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows, cols, mask = _tile(n_rows, n_cols, ROWS, BLOCK)
    gate, up = _load_gate_up(x_ptr, bias_ptr, rows, cols, mask, n_cols)
    grad_out = tl.load(grad_out_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    if weights_ptr is not None:
        row_mask = rows < n_rows
        partial = tl.sum(grad_out * silu * up, axis=1)
        tl.store(grad_weights_ptr + rows * tl.num_programs(1) + tl.program_id(1), partial, mask=row_mask)
        grad_out *= tl.load(weights_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    grad_gate = grad_out * up * sig * (1.0 + gate * (1.0 - sig))
    grad_tile = grad_x_ptr + rows[:, None] * 2 * n_cols + cols[None, :]
    tl.store(grad_tile, grad_gate.to(grad_x_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_tile + n_cols, (grad_out * silu).to(grad_x_ptr.dtype.element_ty), mask=mask)


def _launch(device: torch.device, n_rows: int, n_cols: int, backward: bool) -> tuple[tuple[int, int], dict]:
    """(grid, launch kwargs) of the forward or backward kernel from this platform's tuning row."""
    tuning, prefix = SWIGLU_TUNING[platform(device)], "backward_" if backward else ""
    block = min(next_power_of_2(n_cols), tuning[prefix + "block"])
    rows = tuning[prefix + "rows"]
    grid = (cdiv(n_rows, rows), cdiv(n_cols, block))
    return grid, {"ROWS": rows, "BLOCK": block, "num_warps": tuning[prefix + "warps"]}


class SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weights, bias):
        x2d = flat_rows(x)
        n_rows, n_cols = x2d.shape[0], x2d.shape[1] // 2
        w1d = None if weights is None else weights.reshape(n_rows).contiguous()
        out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
        grid, settings = _launch(x.device, n_rows, n_cols, backward=False)
        launch(_swiglu_forward_kernel, grid, x2d, bias, w1d, out, n_rows, n_cols, **settings)
        ctx.save_for_backward(x2d, w1d, bias)
        ctx.weights_shape = None if weights is None else weights.shape
        return out.view(*x.shape[:-1], n_cols)

    @staticmethod
    def backward(ctx, grad_out):
        x2d, w1d, bias = ctx.saved_tensors
        n_rows, n_cols = x2d.shape[0], x2d.shape[1] // 2
        grid, settings = _launch(x2d.device, n_rows, n_cols, backward=True)
        grad_x = torch.empty_like(x2d)
        grad_w = None if w1d is None else torch.empty((n_rows, grid[1]), dtype=torch.float32, device=x2d.device)
        launch(_swiglu_backward_kernel, grid, flat_rows(grad_out), x2d, bias, w1d, grad_x, grad_w, n_rows, n_cols,
               **settings)
        grad_x = grad_x.view(*grad_out.shape[:-1], 2 * n_cols)
        grad_weights = None if w1d is None else grad_w.sum(1).to(w1d.dtype).view(ctx.weights_shape)
        grad_bias = None if bias is None or not ctx.needs_input_grad[2] else grad_x.reshape(n_rows, -1).sum(0)
        return grad_x, grad_weights, grad_bias


def swiglu(x: torch.Tensor, weights: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Fused SwiGLU; same contract as ``ops.experts.swiglu``."""
    if x.shape[-1] % 2:
        raise ValueError(f"swiglu needs the packed [gate ‖ up] last dim to be even, got {x.shape[-1]}")
    if weights is not None and weights.numel() != x[..., 0].numel():
        raise ValueError(f"weights must hold one scale per token ({list(x.shape[:-1])}), got {list(weights.shape)}")
    if bias is not None and bias.shape != x.shape[-1:]:
        raise ValueError(f"bias must have shape [{x.shape[-1]}], got {list(bias.shape)}")
    return SwiGLU.apply(x, weights, bias)


def runs_on(*tensors: torch.Tensor) -> bool:
    """Whether the kernel runs on ``tensors``: all on a GPU, or the kernel is interpreted."""
    return triton_runs(_swiglu_forward_kernel, *tensors)
