"""ZAYA router epilogue: softmax, biased top-1, gate, skip class and expert counts (Triton, forward and backward).

The ZAYA router MLP emits logits over E experts + 1 "MoD skip" class (docs/architecture.md §4.4-4.8):

    p      = softmax(logits.float())                      # [T, E+1]
    choice = argmax(p + balancing_biases)                 # biases act on probabilities, for selection only
    gate   = p[choice]                                    # unbiased, not renormalised; gradient flows through p

and the epilogue hands Megatron's MoE layer ``probs`` [T, E] (gate at the chosen real expert, 0 elsewhere),
``routing_map`` [T, E] (bool), plus ``skip_gate`` [T] (p_skip where the skip class won, else 0: the caller
applies identity x p_skip or drops the token) and per-class token counts [E+1] (int64) for the bias
balancing. Unfused this is a dozen small kernels; fused, one pass over the [T, E+1] logits. The backward
(w.r.t. logits, through the gate only) recomputes the softmax from the saved logits and choices.

``router_projection`` is the router's first linear layer (D -> R) on bf16 activations: ZAYA1 runs the router
in fp32, and upcasting the [T, D] activations and the weight makes that an fp32 (SIMT) GEMM, ~15x slower than
a bf16 one. Products of bf16 values are exact in fp32, so a bf16 GEMM with fp32 accumulation and output
computes the same forward (up to summation order). The backward rounds the fp32 output gradient to bf16 for
its two GEMMs, as every bf16 linear layer of the model does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..model.router import route_top1 as route_top1_reference
from ..model.router import router_projection as router_projection_reference
from .utils import matmul_fp32, platform, triton_runs

#: Launch settings per platform (``benchmarks/tune_launch.py --kernel router``): each program of the forward
#: (backward) kernel takes ``tokens`` (``backward_tokens``) tokens with ``warps`` (``backward_warps``) warps.
ROUTER_TUNING = {  # H200, 40 settings, T = 8192: forward 4.6 µs, + backward 8.6 µs (was 4.9, 9.4; 2026-11-30)
    "cuda": {"tokens": 32, "warps": 8, "backward_tokens": 16, "backward_warps": 8},
    "rocm": {"tokens": 32, "warps": 4, "backward_tokens": 32, "backward_warps": 4},  # not tuned: the CUDA row
    "cpu": {"tokens": 32, "warps": 4, "backward_tokens": 32, "backward_warps": 4},
}


@triton.jit
def _router_forward_kernel(
    logits_ptr,  # [T, C] (C = E + 1 classes)
    biases_ptr,  # [C] fp32
    probs_ptr,  # [T, E] fp32
    routing_map_ptr,  # [T, E] uint8 (a bool tensor's storage)
    skip_gate_ptr,  # [T] fp32
    choice_ptr,  # [T] int32, saved for the backward
    counts_ptr,  # [C] int64, zero-initialised
    n_tokens,
    n_classes,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_C)
    row_mask = rows < n_tokens
    col_mask = cols < n_classes
    rows64 = tl.cast(rows, tl.int64)
    logits = tl.load(logits_ptr + rows64[:, None] * n_classes + cols[None, :],
                     mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)  # fmt: skip
    logits = tl.where(col_mask[None, :], logits, float("-inf"))
    exp = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = exp / tl.sum(exp, axis=1)[:, None]
    biases = tl.load(biases_ptr + cols, mask=col_mask, other=float("-inf"))
    choice = tl.argmax(probs + biases[None, :], axis=1)
    chosen = cols[None, :] == choice[:, None]
    gate = tl.sum(tl.where(chosen, probs, 0.0), axis=1)

    n_experts = n_classes - 1
    expert_mask = row_mask[:, None] & (cols[None, :] < n_experts)
    out_offsets = rows64[:, None] * n_experts + cols[None, :]
    tl.store(probs_ptr + out_offsets, tl.where(chosen, gate[:, None], 0.0), mask=expert_mask)
    tl.store(routing_map_ptr + out_offsets, chosen.to(tl.uint8), mask=expert_mask)
    tl.store(skip_gate_ptr + rows, tl.where(choice == n_experts, gate, 0.0), mask=row_mask)
    tl.store(choice_ptr + rows, choice.to(tl.int32), mask=row_mask)
    counts = tl.sum((chosen & row_mask[:, None]).to(tl.int64), axis=0)
    tl.atomic_add(counts_ptr + cols, counts, mask=col_mask)


@triton.jit
def _router_backward_kernel(
    grad_probs_ptr,  # [T, E]
    grad_skip_ptr,  # [T]
    logits_ptr,  # [T, C]
    choice_ptr,  # [T] int32
    grad_logits_ptr,  # [T, C] in logits' dtype
    n_tokens,
    n_classes,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_C)
    row_mask = rows < n_tokens
    col_mask = cols < n_classes
    rows64 = tl.cast(rows, tl.int64)
    offsets = rows64[:, None] * n_classes + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    logits = tl.load(logits_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    logits = tl.where(col_mask[None, :], logits, float("-inf"))
    exp = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = exp / tl.sum(exp, axis=1)[:, None]
    choice = tl.load(choice_ptr + rows, mask=row_mask, other=0)
    n_experts = n_classes - 1
    expert_chosen = row_mask & (choice < n_experts)
    grad_expert = tl.load(grad_probs_ptr + rows64 * n_experts + choice, mask=expert_chosen, other=0.0)
    grad_skip = tl.load(grad_skip_ptr + rows, mask=row_mask & (choice == n_experts), other=0.0)
    chosen = cols[None, :] == choice[:, None]
    gate = tl.sum(tl.where(chosen, probs, 0.0), axis=1)
    grad_gate = (grad_expert + grad_skip).to(tl.float32) * gate  # d gate / d logit_j = gate * (1[j = c] - p_j)
    grad_logits = grad_gate[:, None] * (chosen.to(tl.float32) - probs)
    tl.store(grad_logits_ptr + offsets, grad_logits.to(grad_logits_ptr.dtype.element_ty), mask=mask)


def _launch(device: torch.device, n_tokens: int, n_classes: int, backward: bool) -> tuple[tuple[int], dict]:
    """(grid, launch kwargs) of the forward or backward kernel from this platform's tuning row."""
    tuning, prefix = ROUTER_TUNING[platform(device)], "backward_" if backward else ""
    tokens, warps = tuning[prefix + "tokens"], tuning[prefix + "warps"]
    return (triton.cdiv(n_tokens, tokens),), {"BLOCK_T": tokens, "BLOCK_C": triton.next_power_of_2(n_classes),
                                              "num_warps": warps}


class _RouteTop1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits2d, biases):
        n_tokens, n_classes = logits2d.shape
        device = logits2d.device
        probs = torch.empty((n_tokens, n_classes - 1), dtype=torch.float32, device=device)
        routing_map = torch.empty((n_tokens, n_classes - 1), dtype=torch.bool, device=device)
        skip_gate = torch.empty(n_tokens, dtype=torch.float32, device=device)
        choice = torch.empty(n_tokens, dtype=torch.int32, device=device)
        counts = torch.zeros(n_classes, dtype=torch.int64, device=device)
        grid, launch = _launch(device, n_tokens, n_classes, backward=False)
        _router_forward_kernel[grid](
            logits2d, biases.float().contiguous(), probs, routing_map.view(torch.uint8), skip_gate, choice, counts,
            n_tokens, n_classes, **launch,
        )  # fmt: skip
        ctx.save_for_backward(logits2d, choice)
        ctx.mark_non_differentiable(routing_map, counts)
        return probs, routing_map, skip_gate, counts

    @staticmethod
    def backward(ctx, grad_probs, _grad_map, grad_skip, _grad_counts):
        logits2d, choice = ctx.saved_tensors
        n_tokens, n_classes = logits2d.shape
        grad_logits = torch.empty_like(logits2d)
        grid, launch = _launch(logits2d.device, n_tokens, n_classes, backward=True)
        _router_backward_kernel[grid](
            grad_probs.contiguous(), grad_skip.contiguous(), logits2d, choice, grad_logits, n_tokens, n_classes,
            **launch,
        )  # fmt: skip
        return grad_logits, None


def route_top1(
    logits: torch.Tensor, biases: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused ZAYA top-1 routing; same contract as :func:`route_top1_reference`."""
    if logits.shape[-1] != num_experts + 1:
        raise ValueError(
            f"router logits end in {logits.shape[-1]} classes; expected num_experts + 1 = {num_experts + 1} "
            "(the last class is the MoD skip)"
        )
    if biases.shape != (num_experts + 1,):
        raise ValueError(f"balancing biases must have shape [{num_experts + 1}], got {list(biases.shape)}")
    if not triton_runs(_router_forward_kernel, logits, biases):
        return route_top1_reference(logits, biases, num_experts)
    return _RouteTop1.apply(logits.reshape(-1, num_experts + 1).contiguous(), biases.detach())


class _RouterProjection(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        x2d = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2d, weight)
        ctx.bias_dtype = bias.dtype
        return (matmul_fp32(x2d, weight.t()) + bias.float()).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x2d, weight = ctx.saved_tensors
        grad32 = grad_out.reshape(-1, weight.shape[0])
        grad = grad32.to(x2d.dtype)
        grad_x = (grad @ weight).view(*grad_out.shape[:-1], x2d.shape[-1])
        grad_weight = matmul_fp32(grad.t(), x2d).to(weight.dtype)
        return grad_x, grad_weight, grad32.sum(0).to(ctx.bias_dtype)


def router_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """:func:`router_projection_reference` as a bf16 GEMM with fp32 output where x and weight are bf16/fp16;
    the reference for fp32 inputs."""
    if not (x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype):
        return router_projection_reference(x, weight, bias)
    return _RouterProjection.apply(x, weight, bias)
