"""ZAYA router kernels (Triton, forward and backward): the fused router head, its top-1 epilogue, the projection.

The ZAYA router MLP emits logits over E experts + 1 "MoD skip" class (docs/architecture.md §4.4-4.8):

    p      = softmax(logits.float())                      # [T, E+1]
    choice = argmax(p + balancing_biases)                 # biases act on probabilities, for selection only
    gate   = p[choice]                                    # unbiased, not renormalised; gradient flows through p

and the epilogue hands Megatron's MoE layer ``probs`` [T, E] (gate at the chosen real expert, 0 elsewhere),
``routing_map`` [T, E] (bool), plus ``skip_gate`` [T] (p_skip where the skip class won, else 0: the caller
applies identity x p_skip or drops the token) and per-class token counts [E+1] (int64) for the bias
balancing. Unfused this is a dozen small kernels; fused (``route_top1``), one pass over the [T, E+1] logits.
The backward (w.r.t. logits, through the gate only) recomputes the softmax from the saved logits and choices.

``route_head`` fuses everything after the projection: EDA (r = u + s ⊙ r_prev), RMSNorm, fc1 + GELU,
fc2 + GELU, out_proj and the epilogue above. An eager ZAYA1 layer is host-bound on GPUs (~340 launches per
forward + backward), and torch spends ~100 of them on this head (weight casts to fp32, a 7-op RMSNorm, three
fp32 linears and GELUs, their backward). Fused: forward one kernel (+ the counts' zero fill); backward one
kernel, one reduction of its per-program vector-gradient partial sums, two batched GEMMs over slices of the
tokens (d W1 with d W2, and d W3) and their sums over the slices, plus three casts when the parameters are bf16.
Each program takes a block of tokens; fc1's outputs come a chunk at a time and feed fc2's accumulator at once,
so no [T, R] activation is written in the forward but the state r. The backward saves only the inputs and
recomputes the forward in its kernel. fc1's pre-activations wait in the memory of their gradient: fc1's backward
needs fc2's full gradient first, and reading them back costs less than computing fc1 twice. It writes the [T, R]
operands of the weight GEMMs (fp32, freed once they are done) instead of the seven [T, R] fp32 activations torch
keeps from forward to backward.
Weights are read in their dtype and upcast in registers; all math is fp32. No float atomics: the parameter
gradients are reproducible bit for bit. The fp32 ``tl.dot`` precision is per platform
(``ROUTER_HEAD_TUNING``): "tf32x3" (about fp32 accuracy on tensor cores) on CUDA, "ieee" elsewhere.

``router_projection`` is the router's first linear layer (D -> R) on bf16 activations: ZAYA1 runs the router
in fp32, and upcasting the [T, D] activations and the weight makes that an fp32 (SIMT) GEMM, ~15x slower than
a bf16 one. Products of bf16 values are exact in fp32, so a bf16 GEMM with fp32 accumulation and output
computes the same forward (up to summation order). The backward rounds the fp32 output gradient to bf16 for
its two GEMMs, as every bf16 linear layer of the model does.

The torch references, the fallback and the choice live in ``ops/router.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch
from .utils import (added_to_main_grad, cdiv, main_grad_targets, matmul_fp32, matmul_fp32_into, next_power_of_2,
                    platform, triton_runs)

#: Launch settings per platform (``benchmarks/tune_launch.py --kernel router``): each program of the forward
#: (backward) kernel takes ``tokens`` (``backward_tokens``) tokens with ``warps`` (``backward_warps``) warps.
ROUTER_TUNING = {  # H200, 40 settings, T = 8192: forward 4.6 µs, + backward 8.6 µs (2026-11-30)
    "cuda": {"tokens": 32, "warps": 8, "backward_tokens": 16, "backward_warps": 8},
    "rocm": {"tokens": 32, "warps": 4, "backward_tokens": 32, "backward_warps": 4},  # not tuned: the CUDA row
    "cpu": {"tokens": 32, "warps": 4, "backward_tokens": 32, "backward_warps": 4},
}


@triton.jit
def _route_top1_block(
    logits,  # [BLOCK_T, BLOCK_C] fp32; columns from n_classes on are ignored
    rows, cols, n_tokens, n_classes,
    biases_ptr, probs_ptr, routing_map_ptr, skip_gate_ptr, choice_ptr, counts_ptr,
):
    """The routing outputs of one block of tokens from its logits (see the module docstring)."""
    row_mask = rows < n_tokens
    col_mask = cols < n_classes
    rows64 = tl.cast(rows, tl.int64)
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
    tl.atomic_add(counts_ptr + cols, counts.to(counts_ptr.dtype.element_ty), mask=col_mask)  # integers: exact


@triton.jit
def _route_top1_grad(
    logits,  # [BLOCK_T, BLOCK_C] fp32; columns from n_classes on are ignored
    rows, cols, n_tokens, n_classes,
    grad_probs_ptr, token_stride, expert_stride, grad_skip_ptr, choice_ptr,
    HAS_GRAD_SKIP: tl.constexpr,
):
    """d loss / d logits [BLOCK_T, BLOCK_C] fp32 of one block of tokens, through the gate only. ``grad_probs``
    is read through its (token, expert) strides: a gradient broadcast over the experts is not copied."""
    row_mask = rows < n_tokens
    rows64 = tl.cast(rows, tl.int64)
    logits = tl.where((cols < n_classes)[None, :], logits, float("-inf"))
    exp = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = exp / tl.sum(exp, axis=1)[:, None]
    choice = tl.load(choice_ptr + rows, mask=row_mask, other=0)
    n_experts = n_classes - 1
    grad_gate = tl.load(grad_probs_ptr + rows64 * token_stride + choice * expert_stride,
                        mask=row_mask & (choice < n_experts), other=0.0).to(tl.float32)  # fmt: skip
    if HAS_GRAD_SKIP:
        grad_gate += tl.load(grad_skip_ptr + rows, mask=row_mask & (choice == n_experts), other=0.0).to(tl.float32)
    chosen = cols[None, :] == choice[:, None]
    gate = tl.sum(tl.where(chosen, probs, 0.0), axis=1)
    grad_gate *= gate  # d gate / d logit_j = gate * (1[j = c] - p_j)
    return grad_gate[:, None] * (chosen.to(tl.float32) - probs)


@triton.jit
def _logits_block(logits_ptr, n_tokens, n_classes, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's block of the [T, C] logits in fp32: rows, cols, offsets, mask, logits."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_C)
    offsets = tl.cast(rows, tl.int64)[:, None] * n_classes + cols[None, :]
    mask = (rows < n_tokens)[:, None] & (cols < n_classes)[None, :]
    return rows, cols, offsets, mask, tl.load(logits_ptr + offsets, mask=mask, other=0.0).to(tl.float32)


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
    rows, cols, _, _, logits = _logits_block(logits_ptr, n_tokens, n_classes, BLOCK_T, BLOCK_C)
    _route_top1_block(logits, rows, cols, n_tokens, n_classes, biases_ptr, probs_ptr, routing_map_ptr,
                      skip_gate_ptr, choice_ptr, counts_ptr)  # fmt: skip


@triton.jit
def _router_backward_kernel(
    grad_probs_ptr,  # [T, E], by its strides
    token_stride, expert_stride,
    grad_skip_ptr,  # [T]
    logits_ptr,  # [T, C]
    choice_ptr,  # [T] int32
    grad_logits_ptr,  # [T, C] in logits' dtype
    n_tokens,
    n_classes,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows, cols, offsets, mask, logits = _logits_block(logits_ptr, n_tokens, n_classes, BLOCK_T, BLOCK_C)
    grad_logits = _route_top1_grad(logits, rows, cols, n_tokens, n_classes, grad_probs_ptr, token_stride,
                                   expert_stride, grad_skip_ptr, choice_ptr, HAS_GRAD_SKIP=True)  # fmt: skip
    tl.store(grad_logits_ptr + offsets, grad_logits.to(grad_logits_ptr.dtype.element_ty), mask=mask)


def _launch(device: torch.device, n_tokens: int, n_classes: int, backward: bool) -> tuple[tuple[int], dict]:
    """(grid, launch kwargs) of the forward or backward kernel from this platform's tuning row."""
    tuning, prefix = ROUTER_TUNING[platform(device)], "backward_" if backward else ""
    tokens, warps = tuning[prefix + "tokens"], tuning[prefix + "warps"]
    return (cdiv(n_tokens, tokens),), {"BLOCK_T": tokens, "BLOCK_C": next_power_of_2(n_classes), "num_warps": warps}


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
        grid, settings = _launch(device, n_tokens, n_classes, backward=False)
        launch(_router_forward_kernel, grid,
            logits2d, biases.float().contiguous(), probs, routing_map.view(torch.uint8), skip_gate, choice, counts,
            n_tokens, n_classes, **settings,
        )  # fmt: skip
        ctx.save_for_backward(logits2d, choice)
        ctx.mark_non_differentiable(routing_map, counts)
        return probs, routing_map, skip_gate, counts

    @staticmethod
    def backward(ctx, grad_probs, _grad_map, grad_skip, _grad_counts):
        logits2d, choice = ctx.saved_tensors
        n_tokens, n_classes = logits2d.shape
        grad_logits = torch.empty_like(logits2d)
        grid, settings = _launch(logits2d.device, n_tokens, n_classes, backward=True)
        launch(_router_backward_kernel, grid,
            grad_probs, *grad_probs.stride(), grad_skip.contiguous(), logits2d, choice, grad_logits, n_tokens,
            n_classes, **settings,
        )  # fmt: skip
        return grad_logits, None


def route_top1(
    logits: torch.Tensor, biases: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused ZAYA top-1 routing; same contract as ``ops.router.route_top1`` (with the skip class)."""
    if logits.shape[-1] != num_experts + 1:
        raise ValueError(
            f"router logits end in {logits.shape[-1]} classes; expected num_experts + 1 = {num_experts + 1} "
            "(the last class is the MoD skip)"
        )
    if biases.shape != (num_experts + 1,):
        raise ValueError(f"balancing biases must have shape [{num_experts + 1}], got {list(biases.shape)}")
    return _RouteTop1.apply(logits.reshape(-1, num_experts + 1).contiguous(), biases.detach())


#: Launch settings of the fused head per platform, forward (backward): ``tokens`` (``backward_tokens``) tokens per
#: program with ``warps`` (``backward_warps``) warps; ``chunk`` (``backward_chunk``): fc1's outputs taken that many
#: at a time (fc1's activation then never exists whole: each chunk feeds fc2's accumulator); ``stages``
#: (``backward_stages``): software pipelining of the chunk loop (each stage holds a chunk of W1 and of W2 in shared
#: memory); ``precision``: of the fp32 ``tl.dot``s. "tf32x3" on CUDA (three TF32 products, ~fp32 accuracy, on tensor
#: cores; ``tests/gpu/test_kernels_gpu.py`` holds it to the fp32 reference's error), "ieee" elsewhere (the
#: interpreter; MI300X: not measured yet). The CUDA forward: the best of 24 settings on one H100 at T = 8192
#: (``benchmarks/tune_launch.py --kernel router_head``), 0.112 ms against 0.258 ms for (32, 8, 64, 1) before it; the
#: backward, the best of 16 on one H100, forward + backward 0.819 ms against 1.060 ms for (16, 8, 64, 1). On gfx942
#: chunks of 16 and a 4-warp backward are what fit in 64 KB of LDS without spills at R = 256 (compiled by
#: tests/unit/test_kernel_compile.py). ``wgrad_slice``: the weight gradients sum over all T tokens into outputs of
#: [R, R] and [C, R], a handful of output tiles: as one GEMM each, most of the GPU idles (an H200 took 0.31 ms for
#: d W1 and d W2 at T = 8192). They run as a batch of GEMMs over slices of this many tokens, then a sum over the
#: slices (a fixed order); 512 is not tuned yet.
ROUTER_HEAD_TUNING = {
    "cuda": {"tokens": 16, "warps": 4, "chunk": 32, "stages": 2, "backward_tokens": 16, "backward_warps": 4,
             "backward_chunk": 32, "backward_stages": 1, "precision": "tf32x3", "wgrad_slice": 512},
    "rocm": {"tokens": 32, "warps": 8, "chunk": 16, "stages": 1, "backward_tokens": 16, "backward_warps": 4,
             "backward_chunk": 16, "backward_stages": 1, "precision": "ieee", "wgrad_slice": 512},
    # the interpreter: several programs and chunks at the tests' shapes, token slices with a shorter last one
    "cpu": {"tokens": 16, "warps": 4, "chunk": 16, "stages": 1, "backward_tokens": 16, "backward_warps": 4,
            "backward_chunk": 16, "backward_stages": 1, "precision": "ieee", "wgrad_slice": 12},
}  # fmt: skip
#: The widest router (R) the fused head keeps in registers (ZAYA1-8B: 256); wider ones run the reference head.
HEAD_MAX_WIDTH = 256


@triton.jit
def _gelu(x):
    return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))  # exact (erf) GELU, F.gelu's default


@triton.jit
def _gelu_grad(x):
    return 0.5 * (1.0 + tl.erf(x * 0.7071067811865476)) + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)


@triton.jit
def _router_state(u_ptr, state_in_ptr, eda_ptr, bias_ptr, offsets, mask, k, k_mask, HAS_STATE: tl.constexpr,
                  HAS_BIAS: tl.constexpr):
    """r = u + state_in * eda_scale (EDA; r = u without an incoming state) of one block, fp32; with ``HAS_BIAS``,
    u is the projection without its bias, added here first (as the projection adds it)."""
    r = tl.load(u_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        r += tl.load(bias_ptr + k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_STATE:
        eda = tl.load(eda_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        r += tl.load(state_in_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * eda[None, :]
    return r


@triton.jit
def _w1_chunk(w1_ptr, c0, width, k, k_mask, CHUNK: tl.constexpr):
    """W1's outputs c0 .. c0 + CHUNK: [CHUNK, BLOCK_R], fp32."""
    c = c0 + tl.arange(0, CHUNK)
    return tl.load(w1_ptr + c[:, None] * width + k[None, :], mask=(c < width)[:, None] & k_mask[None, :],
                   other=0.0).to(tl.float32)  # fmt: skip


@triton.jit
def _fc1_chunk(z0, w1_ptr, b1_ptr, c0, width, k, k_mask, CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    """fc1's pre-activations for outputs c0 .. c0 + CHUNK: [BLOCK_T, CHUNK]."""
    c = c0 + tl.arange(0, CHUNK)
    b1 = tl.load(b1_ptr + c, mask=c < width, other=0.0).to(tl.float32)
    w1 = _w1_chunk(w1_ptr, c0, width, k, k_mask, CHUNK)
    return tl.dot(z0, tl.trans(w1), input_precision=PRECISION) + b1[None, :]


@triton.jit
def _fc2_chunk(w2_ptr, c0, width, k, k_mask, CHUNK: tl.constexpr):
    """W2's inputs c0 .. c0 + CHUNK: [BLOCK_R, CHUNK] (outputs by rows), fp32."""
    c = c0 + tl.arange(0, CHUNK)
    return tl.load(w2_ptr + k[:, None] * width + c[None, :], mask=k_mask[:, None] & (c < width)[None, :],
                   other=0.0).to(tl.float32)  # fmt: skip


@triton.jit
def _chunk_block(rows64, row_mask, c0, width, CHUNK: tl.constexpr):
    """Columns c0 .. c0 + CHUNK of this program's rows in a [T, R] plane: (columns, offsets, mask)."""
    c = c0 + tl.arange(0, CHUNK)
    return c, rows64[:, None] * width + c[None, :], row_mask[:, None] & (c < width)[None, :]


@triton.jit
def _head_forward_kernel(
    u_ptr, state_in_ptr, eda_ptr, bias_ptr,  # [T, R] fp32, [T, R] (or unused), [R], [R] (or unused)
    norm_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, w3_ptr,  # [R], [R, R], [R], [R, R], [R], [C, R]: any float dtype
    biases_ptr,  # [C] fp32
    state_ptr,  # [T, R] fp32: r
    probs_ptr, routing_map_ptr, skip_gate_ptr, choice_ptr, counts_ptr,  # as _router_forward_kernel's
    n_tokens, eps,
    width: tl.constexpr, n_classes: tl.constexpr,  # model constants: folded into the address arithmetic
    HAS_STATE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    k = tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    row_mask, k_mask = rows < n_tokens, k < width
    offsets = tl.cast(rows, tl.int64)[:, None] * width + k[None, :]
    mask = row_mask[:, None] & k_mask[None, :]

    r = _router_state(u_ptr, state_in_ptr, eda_ptr, bias_ptr, offsets, mask, k, k_mask, HAS_STATE, HAS_BIAS)
    tl.store(state_ptr + offsets, r, mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(r * r, axis=1) / width + eps)
    z0 = tl.load(norm_ptr + k, mask=k_mask, other=0.0).to(tl.float32)[None, :] * (r * rstd[:, None])
    a2 = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for c0 in range(0, BLOCK_R, CHUNK):
        a1 = _fc1_chunk(z0, w1_ptr, b1_ptr, c0, width, k, k_mask, CHUNK, PRECISION)
        a2 = tl.dot(_gelu(a1), tl.trans(_fc2_chunk(w2_ptr, c0, width, k, k_mask, CHUNK)), a2,
                    input_precision=PRECISION)  # fmt: skip
    h2 = _gelu(a2 + tl.load(b2_ptr + k, mask=k_mask, other=0.0).to(tl.float32)[None, :])
    w3 = tl.load(w3_ptr + cols[:, None] * width + k[None, :], mask=(cols < n_classes)[:, None] & k_mask[None, :],
                 other=0.0).to(tl.float32)  # fmt: skip
    logits = tl.dot(h2, tl.trans(w3), input_precision=PRECISION)
    _route_top1_block(logits, rows, cols, n_tokens, n_classes, biases_ptr, probs_ptr, routing_map_ptr,
                      skip_gate_ptr, choice_ptr, counts_ptr)  # fmt: skip


@triton.jit
def _head_backward_kernel(
    u_ptr, state_in_ptr, eda_ptr, bias_ptr, norm_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, w3_ptr,  # as the forward's
    choice_ptr,  # [T] int32 from the forward
    grad_probs_ptr, grad_skip_ptr, grad_state_ptr,  # [T, E], [T] (or unused), [T, R] (or unused)
    token_stride, expert_stride,  # grad_probs's: a gradient broadcast over the experts is not copied
    acts_ptr,  # [3, T, R] fp32: z0 (fc1's input), h1 (fc2's), h2 (out_proj's), for the weight gradients
    grads_ptr,  # [4, T, R] fp32: d a1, d a2 (fc1's, fc2's pre-activations), d u, d state_in (with a state)
    grad_logits_ptr,  # [T, C] fp32
    partials_ptr,  # [programs, 4, R] fp32: this program's sums of d norm_weight, d eda_scale, d b1, d b2
    n_tokens, eps,
    plane,  # T * R: the stride of acts' and grads' slices
    width: tl.constexpr, n_classes: tl.constexpr,
    HAS_STATE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_GRAD_SKIP: tl.constexpr, HAS_GRAD_STATE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    k = tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    row_mask, k_mask, col_mask = rows < n_tokens, k < width, cols < n_classes
    rows64 = tl.cast(rows, tl.int64)
    offsets = rows64[:, None] * width + k[None, :]
    mask = row_mask[:, None] & k_mask[None, :]
    partials_ptr += pid * 4 * width

    # The forward again, keeping what the weight gradients need.
    r = _router_state(u_ptr, state_in_ptr, eda_ptr, bias_ptr, offsets, mask, k, k_mask, HAS_STATE, HAS_BIAS)
    rstd = 1.0 / tl.sqrt(tl.sum(r * r, axis=1) / width + eps)
    norm = tl.load(norm_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
    z0 = norm[None, :] * (r * rstd[:, None])
    tl.store(acts_ptr + offsets, z0, mask=mask)
    a2 = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for c0 in range(0, BLOCK_R, CHUNK):
        a1 = _fc1_chunk(z0, w1_ptr, b1_ptr, c0, width, k, k_mask, CHUNK, PRECISION)
        h1 = _gelu(a1)
        _, chunk_offsets, chunk_mask = _chunk_block(rows64, row_mask, c0, width, CHUNK)
        tl.store(acts_ptr + plane + chunk_offsets, h1, mask=chunk_mask)
        # a1 waits where its gradient goes (this program's rows only): the loop below reads it, not fc1 again
        tl.store(grads_ptr + chunk_offsets, a1, mask=chunk_mask)
        a2 = tl.dot(h1, tl.trans(_fc2_chunk(w2_ptr, c0, width, k, k_mask, CHUNK)), a2, input_precision=PRECISION)
    a2 += tl.load(b2_ptr + k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
    h2 = _gelu(a2)
    tl.store(acts_ptr + 2 * plane + offsets, h2, mask=mask)
    w3 = tl.load(w3_ptr + cols[:, None] * width + k[None, :], mask=col_mask[:, None] & k_mask[None, :],
                 other=0.0).to(tl.float32)  # fmt: skip
    logits = tl.dot(h2, tl.trans(w3), input_precision=PRECISION)

    # Backward: logits, out_proj, GELU, fc2, GELU, fc1 (by chunks again), RMSNorm, EDA.
    grad_logits = _route_top1_grad(logits, rows, cols, n_tokens, n_classes, grad_probs_ptr, token_stride,
                                   expert_stride, grad_skip_ptr, choice_ptr, HAS_GRAD_SKIP)  # fmt: skip
    tl.store(grad_logits_ptr + rows64[:, None] * n_classes + cols[None, :], grad_logits,
             mask=row_mask[:, None] & col_mask[None, :])  # fmt: skip
    grad_a2 = tl.dot(grad_logits, w3, input_precision=PRECISION) * _gelu_grad(a2)
    tl.store(grads_ptr + plane + offsets, grad_a2, mask=mask)
    tl.store(partials_ptr + 3 * width + k, tl.sum(grad_a2, axis=0), mask=k_mask)
    grad_z0 = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    tl.debug_barrier()  # a1 was stored by the threads of another layout: their writes first
    for c0 in range(0, BLOCK_R, CHUNK):
        c, chunk_offsets, chunk_mask = _chunk_block(rows64, row_mask, c0, width, CHUNK)
        a1 = tl.load(grads_ptr + chunk_offsets, mask=chunk_mask, other=0.0)
        w2 = _fc2_chunk(w2_ptr, c0, width, k, k_mask, CHUNK)
        grad_a1 = tl.dot(grad_a2, w2, input_precision=PRECISION) * _gelu_grad(a1)
        tl.store(grads_ptr + chunk_offsets, grad_a1, mask=chunk_mask)
        tl.store(partials_ptr + 2 * width + c, tl.sum(grad_a1, axis=0), mask=c < width)
        grad_z0 = tl.dot(grad_a1, _w1_chunk(w1_ptr, c0, width, k, k_mask, CHUNK), grad_z0, input_precision=PRECISION)
    # r again from memory: holding it through both loops costs registers
    normed = _router_state(u_ptr, state_in_ptr, eda_ptr, bias_ptr, offsets, mask, k, k_mask, HAS_STATE,
                           HAS_BIAS) * rstd[:, None]
    tl.store(partials_ptr + k, tl.sum(grad_z0 * normed, axis=0), mask=k_mask)
    grad_normed = grad_z0 * norm[None, :]
    grad_r = rstd[:, None] * (grad_normed - normed * (tl.sum(grad_normed * normed, axis=1) / width)[:, None])
    if HAS_GRAD_STATE:
        grad_r += tl.load(grad_state_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(grads_ptr + 2 * plane + offsets, grad_r, mask=mask)
    if HAS_STATE:
        eda = tl.load(eda_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        tl.store(grads_ptr + 3 * plane + offsets, grad_r * eda[None, :], mask=mask)
        state_in = tl.load(state_in_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(partials_ptr + width + k, tl.sum(grad_r * state_in, axis=0), mask=k_mask)
    else:
        tl.store(partials_ptr + width + k, tl.zeros((BLOCK_R,), dtype=tl.float32), mask=k_mask)


def _head_launch(device: torch.device, n_tokens: int, width: int, n_classes: int, backward: bool):
    """(grid, launch kwargs) of the fused head's forward or backward kernel from this platform's tuning row."""
    tuning, prefix = ROUTER_HEAD_TUNING[platform(device)], "backward_" if backward else ""
    tokens, block_r = tuning[prefix + "tokens"], max(16, next_power_of_2(width))  # tl.dot: sizes >= 16
    return (cdiv(n_tokens, tokens),), {
        "BLOCK_T": tokens, "BLOCK_R": block_r, "BLOCK_C": max(16, next_power_of_2(n_classes)),
        "CHUNK": min(tuning[prefix + "chunk"], block_r), "PRECISION": tuning["precision"],
        "num_warps": tuning[prefix + "warps"], "num_stages": tuning[prefix + "stages"],
    }  # fmt: skip


class RouteHead(torch.autograd.Function):
    """:func:`route_head` by one kernel forward; backward one kernel (which recomputes the forward) and the
    weight gradients' GEMMs over its [T, R] intermediates. Given ``down_bias``, the projection's bias, ``u2d`` is
    the projection without it: the kernels add it, saving the projection's separate addition (and its cast). Given
    ``counts_into`` (a step's tokens per class, fp32 or int64), the counts are added into it, and it is returned
    as the counts, instead of a fresh zeroed tensor that the caller adds."""

    @staticmethod
    def forward(ctx, u2d, state_in2d, eda_scale, norm_weight, w1, b1, w2, b2, w3, biases, eps, down_bias=None,
                counts_into=None):
        n_tokens, width = u2d.shape
        n_classes, device = w3.shape[0], u2d.device
        state = torch.empty((n_tokens, width), dtype=torch.float32, device=device)
        probs = torch.empty((n_tokens, n_classes - 1), dtype=torch.float32, device=device)
        routing_map = torch.empty((n_tokens, n_classes - 1), dtype=torch.bool, device=device)
        skip_gate = torch.empty(n_tokens, dtype=torch.float32, device=device)
        choice = torch.empty(n_tokens, dtype=torch.int32, device=device)
        counts = torch.zeros(n_classes, dtype=torch.int64, device=device) if counts_into is None else counts_into
        has_state = state_in2d is not None
        grid, settings = _head_launch(device, n_tokens, width, n_classes, backward=False)
        launch(_head_forward_kernel, grid,
            u2d, state_in2d if has_state else u2d, eda_scale if has_state else norm_weight,
            norm_weight if down_bias is None else down_bias, norm_weight, w1, b1, w2, b2, w3, biases, state, probs,
            routing_map.view(torch.uint8), skip_gate, choice, counts, n_tokens, eps, width, n_classes,
            HAS_STATE=has_state, HAS_BIAS=down_bias is not None, **settings,
        )  # fmt: skip
        ctx.save_for_backward(u2d, state_in2d, eda_scale, norm_weight, w1, b1, w2, b2, w3, choice, down_bias)
        ctx.eps = eps
        ctx.mark_non_differentiable(routing_map, counts)
        ctx.set_materialize_grads(False)
        return probs, routing_map, state, skip_gate, counts

    @staticmethod
    def backward(ctx, grad_probs, _grad_map, grad_state, grad_skip, _grad_counts):
        u2d, state_in2d, eda_scale, norm_weight, w1, b1, w2, b2, w3, choice, down_bias = ctx.saved_tensors
        n_tokens, width = u2d.shape
        n_classes, device, has_state = w3.shape[0], u2d.device, state_in2d is not None
        if grad_probs is None:
            grad_probs = torch.zeros((n_tokens, n_classes - 1), dtype=torch.float32, device=device)
        fp32 = {"dtype": torch.float32, "device": device}
        acts, grads = torch.empty((3, n_tokens, width), **fp32), torch.empty((4, n_tokens, width), **fp32)
        grad_logits = torch.empty((n_tokens, n_classes), **fp32)
        grid, settings = _head_launch(device, n_tokens, width, n_classes, backward=True)
        partials = torch.empty((grid[0], 4, width), **fp32)
        launch(_head_backward_kernel, grid,
            u2d, state_in2d if has_state else u2d, eda_scale if has_state else norm_weight,
            norm_weight if down_bias is None else down_bias, norm_weight, w1, b1, w2, b2, w3, choice, grad_probs,
            grads if grad_skip is None else grad_skip.contiguous(),
            grads if grad_state is None else grad_state.contiguous(),
            *grad_probs.stride(), acts, grads, grad_logits, partials, n_tokens, ctx.eps, n_tokens * width, width,
            n_classes, HAS_STATE=has_state, HAS_BIAS=down_bias is not None, HAS_GRAD_SKIP=grad_skip is not None,
            HAS_GRAD_STATE=grad_state is not None, **settings,
        )  # fmt: skip
        grad_state_in = grads[3].to(state_in2d.dtype) if has_state else None
        # d norm, d eda, d b1, d b2; and the projection's d bias as RouterProjection sums it, the same bits
        vectors, vector_sums = (norm_weight, eda_scale, b1, b2, down_bias), [*partials.sum(0), None]
        if down_bias is not None:
            vector_sums[-1] = grads[2].sum(0)
        slice_tokens = ROUTER_HEAD_TUNING[platform(device)]["wgrad_slice"]
        d_w12 = _sum_over_tokens(grads[:2], acts[:2], slice_tokens)  # d a1ᵀ z0, d a2ᵀ h1
        d_w3 = _sum_over_tokens(grad_logits[None], acts[2:], slice_tokens)[0]
        params = [p for p in (*vectors, w1, w2, w3) if p is not None]
        targets = main_grad_targets(params)
        if targets is None:  # the parameters share one dtype: one cast for the vectors, one for d W1 and d W2
            d_norm, d_eda, d_b1, d_b2, d_bias = (None if p is None else v.to(p.dtype)
                                                 for v, p in zip(vector_sums, vectors))
            d_w1, d_w2 = d_w12.to(w1.dtype)
            d_w3 = d_w3.to(w3.dtype)
        else:  # added into main_grad in fp32, all in one launch
            add_into(targets, [v for v, p in zip(vector_sums, vectors) if p is not None] + [*d_w12, d_w3])
            d_norm, d_eda, d_b1, d_b2, d_bias, d_w1, d_w2, d_w3 = _with_placeholders(
                (*vectors, w1, w2, w3), added_to_main_grad(params))
        return (grads[2].to(u2d.dtype), grad_state_in, d_eda if eda_scale is not None else None, d_norm, d_w1, d_b1,
                d_w2, d_b2, d_w3, None, None, d_bias, None)  # fmt: skip


ADD_INTO_BLOCK = 1024


@triton.jit
def _add_into_kernel(t0, s0, n0, t1, s1, n1, t2, s2, n2, t3, s3, n3, t4, s4, n4, t5, s5, n5, t6, s6, n6, t7, s7, n7,
                     BLOCK: tl.constexpr):
    """``target += source`` for up to 8 pairs, pair ``program_id(1)``: the sum in fp32, rounded once to the
    target's dtype (what ``Tensor.add_`` gives a bf16 target and an fp32 source)."""
    which = tl.program_id(1)
    target, source, n = t0, s0, n0
    if which == 1:
        target, source, n = t1, s1, n1
    if which == 2:
        target, source, n = t2, s2, n2
    if which == 3:
        target, source, n = t3, s3, n3
    if which == 4:
        target, source, n = t4, s4, n4
    if which == 5:
        target, source, n = t5, s5, n5
    if which == 6:
        target, source, n = t6, s6, n6
    if which == 7:
        target, source, n = t7, s7, n7
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    total = tl.load(target + offsets, mask=mask).to(tl.float32) + tl.load(source + offsets, mask=mask).to(tl.float32)
    tl.store(target + offsets, total.to(target.dtype.element_ty), mask=mask)


def add_into(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``torch._foreach_add_(targets, sources)`` in one launch: contiguous targets of one dtype (a bf16 or fp32
    ``main_grad``) and fp32 sources of their sizes, at most 8 pairs. (Into targets of another dtype than the sources,
    torch's foreach addition takes a launch per pair.)"""
    if len(targets) > 8 or len({t.dtype for t in targets}) > 1:
        raise ValueError(f"add_into: at most 8 targets of one dtype, not {[t.dtype for t in targets]}")
    pairs = [(t, s.contiguous(), t.numel()) for t, s in zip(targets, sources)]
    pairs += [pairs[0][:2] + (0,)] * (8 - len(pairs))  # unused slots: nothing to add
    launch(_add_into_kernel, (cdiv(max(n for *_, n in pairs), ADD_INTO_BLOCK), len(targets)),
           *(x for pair in pairs for x in pair), BLOCK=ADD_INTO_BLOCK)


def _sum_over_tokens(grads: torch.Tensor, acts: torch.Tensor, slice_tokens: int) -> torch.Tensor:
    """``grads[b]ᵀ acts[b]`` for each b: [B, T, M] and [B, T, N] fp32 -> [B, M, N], as one batch of GEMMs over
    slices of ``slice_tokens`` tokens (a shorter last one added after), summed over the slices."""
    batch, tokens, rows = grads.shape
    slices = max(1, tokens // slice_tokens)
    length = tokens // slices
    whole = slices * length
    sliced = [t[:, :whole].unflatten(1, (slices, length)).flatten(0, 1) for t in (grads, acts)]  # [B·S, L, ·]
    sums = torch.bmm(sliced[0].transpose(1, 2), sliced[1]).unflatten(0, (batch, slices)).sum(1)
    if whole < tokens:
        sums.baddbmm_(grads[:, whole:].transpose(1, 2), acts[:, whole:])
    return sums


def _with_placeholders(params, placeholders) -> list:
    """``placeholders`` (one per parameter that is not None) in the places of ``params``, None elsewhere."""
    given = iter(placeholders)
    return [None if p is None else next(given) for p in params]


def route_head(u, state_in, eda_scale, norm_weight, fc1_weight, fc1_bias, fc2_weight, fc2_bias, out_weight,
               biases, eps: float, num_experts: int):
    """The fused router head; same contract as ``ops.router.route_head`` (for routers up to ``HEAD_MAX_WIDTH``)."""
    probs, routing_map, state, skip_gate, counts = RouteHead.apply(*route_head_arguments(
        u, state_in, eda_scale, norm_weight, fc1_weight, fc1_bias, fc2_weight, fc2_bias, out_weight, biases, eps,
        num_experts))
    return probs, routing_map, state.view(*u.shape[:-1], out_weight.shape[1]), skip_gate, counts


def route_head_arguments(u, state_in, eda_scale, norm_weight, fc1_weight, fc1_bias, fc2_weight, fc2_bias, out_weight,
                         biases, eps: float, num_experts: int, down_bias: torch.Tensor | None = None,
                         counts_into: torch.Tensor | None = None) -> tuple:
    """:class:`RouteHead`'s arguments for :func:`route_head`'s, checked: the tokens as rows, everything contiguous;
    with ``down_bias``, the projection's bias that ``u`` lacks, and ``counts_into`` (see :class:`RouteHead`)."""
    n_classes, width = out_weight.shape
    if n_classes != num_experts + 1:
        raise ValueError(
            f"the router's out_proj has {n_classes} classes; expected num_experts + 1 = {num_experts + 1} "
            "(the last class is the MoD skip)"
        )
    if biases.shape != (n_classes,):
        raise ValueError(f"balancing biases must have shape [{n_classes}], got {list(biases.shape)}")
    if width > HEAD_MAX_WIDTH:
        raise ValueError(f"the fused router head holds routers up to {HEAD_MAX_WIDTH} wide, not {width}")
    params = [norm_weight, fc1_weight, fc1_bias, fc2_weight, fc2_bias, out_weight]
    with_state = state_in is not None and eda_scale is not None
    return (u.reshape(-1, width).contiguous(), state_in.reshape(-1, width).contiguous() if with_state else None,
            eda_scale, *(p.contiguous() for p in params), biases.detach().float().contiguous(), float(eps),
            None if down_bias is None else down_bias.contiguous(), counts_into)


class RouterProjection(torch.autograd.Function):
    """:func:`router_projection`; with ``bias`` None the GEMM alone (the fused head adds the bias)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        x2d = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2d, weight)
        ctx.params = (weight,) if bias is None else (weight, bias)
        u = matmul_fp32(x2d, weight.t())
        return (u if bias is None else u + bias.float()).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        return RouterProjection.backward_adding(ctx, grad_out, None)

    @staticmethod
    def backward_adding(ctx, grad_out, other_grad_x: torch.Tensor | None):
        """:meth:`backward`; given ``other_grad_x`` (another gradient of x, contiguous, in x's dtype), x's gradient is
        added into it by the GEMM (one rounding, no addition of its own), and it is returned as x's."""
        x2d, weight = ctx.saved_tensors
        grad32 = grad_out.reshape(-1, weight.shape[0])
        grad = grad32.to(x2d.dtype)
        if other_grad_x is None:
            grad_x = (grad @ weight).view(*grad_out.shape[:-1], x2d.shape[-1])
        else:
            grad_x = other_grad_x
            grad_x.view(-1, x2d.shape[-1]).addmm_(grad, weight)
        targets, has_bias = main_grad_targets(ctx.params), len(ctx.params) == 2
        if targets is None:
            d_bias = grad32.sum(0).to(ctx.params[1].dtype) if has_bias else None
            return grad_x, matmul_fp32(grad.t(), x2d).to(weight.dtype), d_bias
        matmul_fp32_into(targets[0], grad.t(), x2d, accumulate=True)  # added into main_grad in fp32
        if has_bias:
            targets[1].add_(grad32.sum(0))
        return grad_x, *added_to_main_grad(ctx.params), *(() if has_bias else (None,))


def router_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``ops.router.router_projection`` for bf16/fp16 x and weight: a GEMM in their dtype with fp32 output."""
    return RouterProjection.apply(x, weight, bias)


def runs_on(*tensors: torch.Tensor) -> bool:
    """Whether these kernels run on ``tensors``: all on a GPU, or the kernels are interpreted."""
    return triton_runs(_router_forward_kernel, *tensors)
