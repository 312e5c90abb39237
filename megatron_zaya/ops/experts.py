"""ZAYA1's experts: top-1 SwiGLU MLPs over tokens sorted by expert (docs/architecture.md §4.6); kernel op ``experts``.

The sort: :func:`sort_by_expert` orders the tokens by their expert (stable; tokens of no local expert last) and
counts them, without a host sync; the kernel (``kernels/sort_by_expert.py``) does it in one launch.

Each expert has ``fc1 [2F, D]`` (gate rows, then up rows) and ``fc2 [D, F]``; a token's output is
``fc2 (silu(gate) ⊙ up ⊙ p)`` with p its router probability. Without the kernel the model runs Megatron's
``SequentialMLP`` loop over the experts (the same math); with it, two Triton grouped GEMMs
(``kernels/grouped_gemm.py``) around the probability-weighted SwiGLU kernel (``kernels/swiglu.py``): 2 launches
instead of 32 per layer for 16 experts, and no host sync on the token counts. Each GEMM of a grouped GEMM (forward,
input gradient, weight gradient) may run on ``torch._grouped_mm`` instead, where it was measured faster for the GPU
and shape (``ops/grouped_mm.py``).

The tokens may come in a static-size buffer whose tail belongs to no expert (``padded_rows``): its output rows
are zero.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from . import grouped_mm


def swiglu(x: torch.Tensor, weights: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up [* weights]: x [..., 2F], weights [..., 1] or None, bias [2F] or None -> [..., F]."""
    if bias is not None:
        x = x + bias
    gate, up = x.chunk(2, dim=-1)
    out = F.silu(gate) * up
    return out if weights is None else (out * weights).to(x.dtype)


def sort_by_expert(routing_map: torch.Tensor, first: int, num_experts: int):
    """Tokens sorted by their expert among columns ``[first, first + num_experts)`` of the top-1 bool routing map
    ``[T, classes]``, token order kept within an expert, tokens of none of them last: -> ``order [T]`` (token
    indices in sorted order), ``inverse [T]`` (each token's sorted position), ``counts [num_experts]`` (int64)."""
    local_map = routing_map[:, first: first + num_experts]
    expert = torch.where(local_map.any(dim=-1), local_map.byte().argmax(dim=-1), num_experts)
    # A GPU radix sort makes one pass per byte of its keys: the ids as bytes take one pass instead of eight.
    order = torch.argsort(expert.to(torch.uint8 if num_experts < 256 else torch.int16), stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    counts = local_map.sum(dim=0)  # not torch.bincount: on GPUs it syncs to size its output
    return order, inverse, counts


def grouped_gemm(x: torch.Tensor, weight, tokens_per_expert: torch.Tensor, padded_rows: bool = False) -> torch.Tensor:
    """x [N, K] sorted by expert, weight [E, M, K] (or E tensors [M, K]), tokens_per_expert [E] -> [N, M] in x's
    dtype. ``padded_rows``: the counts may sum to less than N; the remaining rows of the output are zero."""
    weight = weight if isinstance(weight, torch.Tensor) else torch.stack(list(weight))
    counts = tokens_per_expert.tolist()
    tail = x.shape[0] - sum(counts) if padded_rows else 0
    pieces = x.split([*counts, tail])
    out = [piece @ weight[e].t() for e, piece in enumerate(pieces[: len(counts)])]
    return torch.cat([*out, x.new_zeros(tail, weight.shape[1])])


def experts(hidden: torch.Tensor, fc1, fc2, tokens_per_expert: torch.Tensor, probs: torch.Tensor,
            grouped_gemms=(grouped_gemm, grouped_gemm), swiglu=swiglu) -> torch.Tensor:
    """The experts on ``hidden [N, D]`` sorted by expert (a zero tail past the routed tokens), ``fc1``/``fc2`` the
    experts' weights (lists of ``[2F, D]`` and ``[D, F]``), ``probs [N]`` -> ``[N, D]`` in hidden's dtype.
    ``grouped_gemms``: the grouped GEMM functions of fc1 and of fc2."""
    counts = tokens_per_expert.to(device=hidden.device, dtype=torch.int64)
    fc1_gemm, fc2_gemm = grouped_gemms
    intermediate = swiglu(fc1_gemm(hidden, fc1, counts, padded_rows=True), weights=probs.unsqueeze(-1))
    return fc2_gemm(intermediate.to(hidden.dtype), fc2, counts, padded_rows=True)


# ----------------------------------------------------------------------------------------- the Triton kernels


def fused_sort_by_expert(routing_map: torch.Tensor, first: int, num_experts: int):
    """:func:`sort_by_expert` by the Triton kernel (one launch) where it runs, else the reference."""
    from ..kernels import sort_by_expert as kernel

    if kernel.runs_on(routing_map):
        return kernel.sort_by_expert(routing_map, first, num_experts)
    return sort_by_expert(routing_map, first, num_experts)


def fused_swiglu(x: torch.Tensor, weights: torch.Tensor | None = None, bias: torch.Tensor | None = None):
    """:func:`swiglu` by the Triton kernel (fp32 math, one pass each way) where it runs, else the reference."""
    from ..kernels import swiglu as kernel  # imported when first called: triton only where a kernel is chosen

    if kernel.runs_on(*(t for t in (x, weights, bias) if t is not None)):
        return kernel.swiglu(x, weights, bias)
    return swiglu(x, weights, bias)


def fused_grouped_gemm(x: torch.Tensor, weight, tokens_per_expert: torch.Tensor, padded_rows: bool = False,
                       backends: grouped_mm.Backends = grouped_mm.TRITON):
    """:func:`grouped_gemm` by the Triton kernel where it runs (separate expert weights read in place), or with
    some of its GEMMs by ``torch._grouped_mm`` as ``backends`` names them, where that runs (``ops/grouped_mm.py``)."""
    from ..kernels import grouped_gemm as kernel

    weights = [weight] if isinstance(weight, torch.Tensor) else list(weight)
    if backends != grouped_mm.TRITON and grouped_mm.runs_on(x, weights, backends):
        return grouped_mm.grouped_gemm(x, weight, tokens_per_expert, padded_rows, backends)
    if kernel.runs_on(x, *weights):
        return kernel.grouped_gemm(x, weight, tokens_per_expert, padded_rows)
    return grouped_gemm(x, weight, tokens_per_expert, padded_rows)


def fused_experts(hidden, fc1, fc2, tokens_per_expert, probs,
                  backends=(grouped_mm.TRITON, grouped_mm.TRITON)) -> torch.Tensor:
    """:func:`experts` as two grouped GEMMs around the weighted SwiGLU, by the Triton kernels; ``backends``: the
    backend of each GEMM of fc1 and of fc2 (``ops/grouped_mm.py``)."""
    gemms = [functools.partial(fused_grouped_gemm, backends=chosen) for chosen in backends]
    return experts(hidden, fc1, fc2, tokens_per_expert, probs, grouped_gemms=gemms, swiglu=fused_swiglu)


@contextmanager
def main_grad_untouched():
    """Within: the kernels' parameter gradients (the grouped GEMM's, the norms' and residual scales') stay out of
    Megatron's ``main_grad`` (they are added there from inside the backward otherwise), e.g. for warm-up passes.
    The switch is ``kernels/utils.py``'s, which every kernel module shares."""
    from ..kernels import grouped_gemm as kernel

    kernel.ACCUMULATE_INTO_MAIN_GRAD["enabled"] = False
    try:
        yield
    finally:
        kernel.ACCUMULATE_INTO_MAIN_GRAD["enabled"] = True


# ----------------------------------------------------------------------------------------- the choice


def choose_sort(config):
    """The sort by expert of the MoE layer's own dispatch: :func:`fused_sort_by_expert` with the ``experts`` op."""
    return fused_sort_by_expert if config.uses_kernel("experts") else sort_by_expert


def choose(config, tensor_parallel_size: int, backends: tuple[grouped_mm.Backends, grouped_mm.Backends]):
    """:func:`fused_experts` with the ``experts`` op, else None (Megatron's ``SequentialMLP`` loop). Expert tensor
    parallelism, fp8/fp4, biases and probabilities applied on the input keep the loop. ``backends``: those of fc1's
    and fc2's GEMMs (:func:`choose_backends`)."""
    loop_only = (config.fp8 or config.fp4 or config.moe_apply_probs_on_input or tensor_parallel_size > 1
                 or config.add_bias_linear)
    if not config.uses_kernel("experts") or loop_only:
        return None
    if all(chosen == grouped_mm.TRITON for chosen in backends):
        return fused_experts
    return functools.partial(fused_experts, backends=backends)


def choose_backends(config, num_local_experts: int) -> tuple[grouped_mm.Backends, grouped_mm.Backends]:
    """The backends of fc1's and fc2's grouped GEMMs, measured fastest for this GPU and shape (``ops/grouped_mm.py``):
    the Triton kernel where nothing was measured."""
    hidden, ffn = config.hidden_size, config.moe_ffn_hidden_size
    fc1, fc2 = grouped_mm.choose_backends(config.params_dtype, [(num_local_experts, 2 * ffn, hidden),
                                                                (num_local_experts, hidden, ffn)])
    return fc1, fc2
