"""SwiGLU on the packed [gate ‖ up] fc1 output, optionally scaled per token (Triton, forward and backward).

ZAYA1's experts store fc1 as one [2F, D] matrix, first F rows = gate, last F = up (docs/zaya1-architecture.md
§4.6), so the activation reads x [..., 2F] and writes silu(gate) * up [..., F]. The optional per-token
``weights`` [..., 1] is Megatron's ``weighted_bias_swiglu`` (the router probability applied inside the
expert); the optional ``bias`` [2F] is Megatron's ``bias_swiglu``. Math in fp32, output in x's dtype.
One read of x and one write per element each way; the backward recomputes silu from x.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .utils import flat_rows, triton_runs

MAX_BLOCK = 4096  # columns of the output per program


def swiglu_reference(
    x: torch.Tensor, weights: torch.Tensor | None = None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """silu(gate) * up [* weights]: x [..., 2F], weights [..., 1] or None, bias [2F] or None -> [..., F]."""
    if bias is not None:
        x = x + bias
    gate, up = x.chunk(2, dim=-1)
    out = F.silu(gate) * up
    return out if weights is None else (out * weights).to(x.dtype)


@triton.jit
def _load_gate_up(x_ptr, bias_ptr, row, cols, mask, n_cols):
    """Row ``row`` of the packed [gate ‖ up] input at ``cols``, plus the bias if any, in fp32."""
    x_row = x_ptr + row * 2 * n_cols
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if bias_ptr is not None:
        gate += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        up += tl.load(bias_ptr + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    return gate, up


@triton.jit
def _forward_kernel(
    x_ptr,  # [T, 2F]
    bias_ptr,  # [2F] or None
    weights_ptr,  # [T] or None
    out_ptr,  # [T, F]
    n_cols,  # F
    BLOCK: tl.constexpr,
):
    row = tl.cast(tl.program_id(0), tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate, up = _load_gate_up(x_ptr, bias_ptr, row, cols, mask, n_cols)
    out = gate * tl.sigmoid(gate) * up
    if weights_ptr is not None:
        out *= tl.load(weights_ptr + row).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(
    grad_out_ptr,  # [T, F]
    x_ptr,  # [T, 2F]
    bias_ptr,  # [2F] or None
    weights_ptr,  # [T] or None
    grad_x_ptr,  # [T, 2F]
    grad_weights_ptr,  # [T, column blocks] fp32 partial sums, or None
    n_cols,
    BLOCK: tl.constexpr,
):
    row = tl.cast(tl.program_id(0), tl.int64)
    col_block = tl.program_id(1)
    cols = col_block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate, up = _load_gate_up(x_ptr, bias_ptr, row, cols, mask, n_cols)
    grad_out = tl.load(grad_out_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    if weights_ptr is not None:
        partial = tl.sum(grad_out * silu * up, axis=0)
        tl.store(grad_weights_ptr + row * tl.num_programs(1) + col_block, partial)
        grad_out *= tl.load(weights_ptr + row).to(tl.float32)
    grad_gate = grad_out * up * sig * (1.0 + gate * (1.0 - sig))
    grad_row = grad_x_ptr + row * 2 * n_cols
    tl.store(grad_row + cols, grad_gate.to(grad_x_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_row + n_cols + cols, (grad_out * silu).to(grad_x_ptr.dtype.element_ty), mask=mask)


def _grid(rows: int, n_cols: int) -> tuple[tuple[int, int], int]:
    block = min(triton.next_power_of_2(n_cols), MAX_BLOCK)
    return (rows, triton.cdiv(n_cols, block)), block


def _num_warps(block: int) -> int:
    return min(8, max(1, block // 256))


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weights, bias):
        x2d = flat_rows(x)
        rows, n_cols = x2d.shape[0], x2d.shape[1] // 2
        w1d = None if weights is None else weights.reshape(rows).contiguous()
        out = torch.empty((rows, n_cols), dtype=x.dtype, device=x.device)
        grid, block = _grid(rows, n_cols)
        _forward_kernel[grid](x2d, bias, w1d, out, n_cols, BLOCK=block, num_warps=_num_warps(block))
        ctx.save_for_backward(x2d, w1d, bias)
        ctx.weights_shape = None if weights is None else weights.shape
        return out.view(*x.shape[:-1], n_cols)

    @staticmethod
    def backward(ctx, grad_out):
        x2d, w1d, bias = ctx.saved_tensors
        rows, n_cols = x2d.shape[0], x2d.shape[1] // 2
        grid, block = _grid(rows, n_cols)
        grad_x = torch.empty_like(x2d)
        grad_w = None if w1d is None else torch.empty(grid, dtype=torch.float32, device=x2d.device)
        _backward_kernel[grid](
            flat_rows(grad_out), x2d, bias, w1d, grad_x, grad_w, n_cols, BLOCK=block, num_warps=_num_warps(block)
        )
        grad_x = grad_x.view(*grad_out.shape[:-1], 2 * n_cols)
        grad_weights = None if w1d is None else grad_w.sum(1).to(w1d.dtype).view(ctx.weights_shape)
        grad_bias = None if bias is None or not ctx.needs_input_grad[2] else grad_x.reshape(rows, -1).sum(0)
        return grad_x, grad_weights, grad_bias


def swiglu(x: torch.Tensor, weights: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Fused SwiGLU; same contract as :func:`swiglu_reference`."""
    if x.shape[-1] % 2:
        raise ValueError(f"swiglu needs the packed [gate ‖ up] last dim to be even, got {x.shape[-1]}")
    if weights is not None and weights.numel() != x[..., 0].numel():
        raise ValueError(f"weights must hold one scale per token ({list(x.shape[:-1])}), got {list(weights.shape)}")
    if bias is not None and bias.shape != x.shape[-1:]:
        raise ValueError(f"bias must have shape [{x.shape[-1]}], got {list(bias.shape)}")
    tensors = [t for t in (x, weights, bias) if t is not None]
    if not triton_runs(_forward_kernel, *tensors):
        return swiglu_reference(x, weights, bias)
    return _SwiGLU.apply(x, weights, bias)
