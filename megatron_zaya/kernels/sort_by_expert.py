"""Top-1 tokens sorted by expert in one launch (Triton): a stable counting sort of the routing map.

Reads the routing map ``[T, ≥ first + E]`` (bool, at most one chosen column per token among the E from ``first``)
and writes the sorted order (token indices by expert, then by token; tokens of none of the E last), its inverse
(each token's sorted position) and the tokens per expert. Each program places one block of tokens. It first counts
the classes over the whole map itself, in steps: the map is small (a byte per token and column), so every program
reading it costs little, and the programs need no second launch, atomics or communication. A token's position is its
class's start (the exclusive cumsum of the totals) plus its class's tokens in earlier blocks plus its rank within
its own block. Given the gates ``[T, ≥ first + E]`` (fp32, the chosen expert's probability in its column), it also
writes each token's gate in sorted order (0 for tokens of none), what the experts scale their outputs by. It stands
for a dozen launches of the torch reference (the chosen column, a multi-pass radix sort, the inverse's scatter, the
counts), which dominate a host-bound MoE dispatch. The reference, the fallback and the choice live in
``ops/experts.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch
from .utils import cdiv, next_power_of_2, platform, triton_runs

#: Launch settings per platform: tokens per program (its block), tokens per step of each program's counting pass,
#: warps per program.
SORT_TUNING = {
    "cuda": {"block": 512, "count_block": 2048, "warps": 8},  # not tuned
    # not tuned; on gfx942 a block of 512 or a count block of 1024 spills (a map whose rows are not 16-byte aligned)
    "rocm": {"block": 256, "count_block": 512, "warps": 16},
    "cpu": {"block": 8, "count_block": 32, "warps": 4},  # the interpreter: several programs, steps, partial last ones
}


@triton.jit
def _token_classes(map_ptr, rows, n_tokens, stride_t, stride_e, first, n_experts, cols):
    """Each token's class, int32 shaped as ``rows``: its expert among the E, else E."""
    chosen = tl.load(map_ptr + rows[:, None] * stride_t + (first + cols)[None, :] * stride_e,
                     mask=(rows < n_tokens)[:, None] & (cols < n_experts)[None, :], other=0).to(tl.int32)
    return tl.where(tl.sum(chosen, axis=1) > 0, tl.sum(chosen * cols[None, :], axis=1), n_experts)


@triton.jit
def _one_hot(expert, rows, n_tokens, cols):
    """[BLOCK, CLASSES] int32: 1 at each token's class (:func:`_token_classes`); 0 for rows past the end."""
    return ((expert[:, None] == cols[None, :]) & (rows < n_tokens)[:, None]).to(tl.int32)


@triton.jit
def _sort_by_expert_kernel(map_ptr, order_ptr, inverse_ptr, counts_ptr, gates_ptr, sorted_gates_ptr, n_tokens,
                           stride_t, stride_e, gate_stride_t, gate_stride_e, first, n_experts, CLASSES: tl.constexpr,
                           BLOCK: tl.constexpr, COUNT_BLOCK: tl.constexpr, HAS_GATES: tl.constexpr):
    cols = tl.arange(0, CLASSES)
    pid = tl.program_id(0)
    block_start = pid * BLOCK
    totals = tl.zeros([CLASSES], dtype=tl.int32)  # each class's tokens, counted by every program: no sync needed
    before = tl.zeros([CLASSES], dtype=tl.int32)  # each class's tokens in the blocks before this program's
    for start in range(0, n_tokens, COUNT_BLOCK):
        rows = start + tl.arange(0, COUNT_BLOCK)
        expert = _token_classes(map_ptr, rows, n_tokens, stride_t, stride_e, first, n_experts, cols)
        totals += tl.histogram(expert, CLASSES, mask=rows < n_tokens)
        before += tl.histogram(expert, CLASSES, mask=rows < block_start)
    if pid == 0:
        tl.store(counts_ptr + cols, totals.to(tl.int64), mask=cols < n_experts)
    offset = tl.cumsum(totals, 0) - totals + before  # where this block's tokens of each class start
    rows = block_start + tl.arange(0, BLOCK)
    expert = _token_classes(map_ptr, rows, n_tokens, stride_t, stride_e, first, n_experts, cols)
    one_hot = _one_hot(expert, rows, n_tokens, cols)
    rank = tl.cumsum(one_hot, 0) - one_hot  # earlier tokens of the same class in this block
    position = tl.sum((rank + offset[None, :]) * one_hot, axis=1)
    in_range = rows < n_tokens
    tl.store(order_ptr + position, rows.to(tl.int64), mask=in_range)
    tl.store(inverse_ptr + rows, position.to(tl.int64), mask=in_range)
    if HAS_GATES:
        gate = tl.load(gates_ptr + rows * gate_stride_t + (first + expert) * gate_stride_e,
                       mask=in_range & (expert < n_experts), other=0.0)
        tl.store(sorted_gates_ptr + position, gate, mask=in_range)


def sort_by_expert(routing_map: torch.Tensor, first: int, num_experts: int, gates: torch.Tensor | None = None):
    """Same contract as ``ops.experts.sort_by_expert``; given ``gates`` (fp32, shaped as the routing map), the
    tokens' gates in sorted order too, a fourth output: ``(gates * routing_map).sum(-1)[order]`` over the E."""
    if routing_map.dim() != 2 or routing_map.dtype != torch.bool:
        raise ValueError(f"sort_by_expert takes a bool routing map [tokens, classes], got {routing_map.dtype} "
                         f"{list(routing_map.shape)}")
    if first < 0 or first + num_experts > routing_map.shape[1]:
        raise ValueError(f"experts [{first}, {first + num_experts}) are not columns of the routing map "
                         f"{list(routing_map.shape)}")
    n_tokens, device = routing_map.shape[0], routing_map.device
    order = torch.empty(n_tokens, dtype=torch.int64, device=device)
    inverse = torch.empty_like(order)
    counts = torch.empty(num_experts, dtype=torch.int64, device=device)
    sorted_gates = None if gates is None else torch.empty(n_tokens, dtype=torch.float32, device=device)
    tuning = SORT_TUNING[platform(device)]
    programs = max(1, cdiv(n_tokens, tuning["block"]))  # no tokens: program 0 still writes the counts
    launch(_sort_by_expert_kernel, (programs,),
        routing_map, order, inverse, counts, routing_map if gates is None else gates,
        order if gates is None else sorted_gates, n_tokens, *routing_map.stride(),
        *(routing_map if gates is None else gates).stride(), first, num_experts,
        CLASSES=next_power_of_2(num_experts + 1), BLOCK=tuning["block"], COUNT_BLOCK=tuning["count_block"],
        HAS_GATES=gates is not None, num_warps=tuning["warps"])  # fmt: skip
    return (order, inverse, counts) if gates is None else (order, inverse, counts, sorted_gates)


def runs_on(*tensors: torch.Tensor) -> bool:
    """Whether the kernel runs on ``tensors``: all on a GPU, or the kernel is interpreted."""
    return triton_runs(_sort_by_expert_kernel, *tensors)
