"""The ZAYA1 router after its MLP's input: the projection, the head (EDA, RMSNorm, MLP) and top-1 routing
(docs/architecture.md §4); kernel ops ``router`` (projection and top-1) and ``router_head`` (the whole head).

Everything runs in fp32 whatever the parameter dtype. ``model/router.py`` holds the module, its balancing and
the equations.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .residual_norm import rms_norm


class RouterWeights(NamedTuple):
    """The router's parameters in one tuple, as ``ops/moe.py`` takes them (``eda_scale`` None without EDA)."""

    down_weight: torch.Tensor
    down_bias: torch.Tensor
    eda_scale: torch.Tensor | None
    norm_weight: torch.Tensor
    fc1_weight: torch.Tensor
    fc1_bias: torch.Tensor
    fc2_weight: torch.Tensor
    fc2_bias: torch.Tensor
    out_weight: torch.Tensor


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """``t.float()``, except that float64 stays float64: the tests' oracle is this reference run in float64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def router_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The router's first layer in fp32, ``x.float() Wᵀ + b``: x [..., D], weight [R, D], bias [R] -> [..., R]."""
    return F.linear(x.float(), weight.float(), bias.float())


def route_top1(logits: torch.Tensor, biases: torch.Tensor, num_experts: int):
    """Top-1 routing on biased probabilities.

    Args: logits ``[T, C]`` (C = E, or E + 1 with the skip class last), biases ``[C]`` fp32.
    Returns: probs ``[T, E]`` fp32 (the unbiased gate at the chosen expert, 0 elsewhere), routing_map
    ``[T, E]`` bool, skip_gate ``[T]`` fp32 (p_skip where the skip class won, else 0), counts ``[C]`` int64.
    """
    probs_all = torch.softmax(_fp32(logits.reshape(-1, biases.numel())), dim=-1)
    choice = torch.argmax(probs_all.detach() + biases, dim=-1)
    gate = probs_all.gather(1, choice[:, None]).squeeze(1)
    # a comparison and a scatter-add, not one_hot and bincount: those copy to the host on GPUs (no graph capture)
    routing_map = choice[:, None] == torch.arange(num_experts, device=choice.device)
    probs = torch.where(routing_map, gate[:, None], 0.0)
    skip_gate = torch.where(choice == num_experts, gate, 0.0)
    counts = torch.zeros(biases.numel(), dtype=torch.int64, device=choice.device)
    return probs, routing_map, skip_gate, counts.scatter_add_(0, choice, torch.ones_like(choice))


def route_head(u, state_in, eda_scale, norm_weight, fc1_weight, fc1_bias, fc2_weight, fc2_bias, out_weight,
               biases, eps: float, num_experts: int, route_top1=route_top1):
    """The router after its projection, in fp32: EDA, RMSNorm, the MLP to logits, top-1 routing.

    Args: u ``[..., R]`` (the projection), state_in ``[..., R]`` (the previous MoE layer's router state, None on
    the first) and the router's parameters (``eda_scale`` None without EDA; weights ``[out, in]``), the balancing
    biases ``[C]``, the RMSNorm epsilon; ``route_top1`` as :func:`route_top1`.
    Returns: probs, routing_map, the router state r_l ``[..., R]`` fp32 (the next MoE layer's router receives it),
    skip_gate, counts (see :func:`route_top1`).
    """
    if eda_scale is not None:
        # The first MoE layer's incoming state is zero. Its scale still joins the graph (zero gradient): Megatron's
        # overlapped gradient reduction waits for every trainable parameter, and its optimizer checkpoints
        # stack the layers' states, so every layer must look alike.
        previous = state_in if state_in is not None else u.new_zeros(())
        u = u + previous * _fp32(eda_scale)
    z = rms_norm(u, _fp32(norm_weight), eps)
    z = F.gelu(F.linear(z, _fp32(fc1_weight), _fp32(fc1_bias)))
    z = F.gelu(F.linear(z, _fp32(fc2_weight), _fp32(fc2_bias)))
    logits = F.linear(z, _fp32(out_weight)).reshape(-1, out_weight.shape[0])
    probs, routing_map, skip_gate, counts = route_top1(logits, biases, num_experts)
    return probs, routing_map, u, skip_gate, counts


# ----------------------------------------------------------------------------------------- the Triton kernels


def _kernel():
    from ..kernels import router  # imported when first called: triton only where a kernel is chosen

    return router


def fused_router_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """:func:`router_projection` as a bf16/fp16 GEMM with fp32 output (the same products); fp32 inputs take the
    reference."""
    if x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype:
        return _kernel().router_projection(x, weight, bias)
    return router_projection(x, weight, bias)


def fused_route_top1(logits: torch.Tensor, biases: torch.Tensor, num_experts: int):
    """:func:`route_top1` (with the skip class) in one Triton pass over the logits where the kernel runs."""
    kernel = _kernel()
    if kernel.runs_on(logits, biases):
        return kernel.route_top1(logits, biases, num_experts)
    return route_top1(logits, biases, num_experts)


def fused_route_head(u, state_in, eda_scale, norm_weight, fc1_weight, fc1_bias, fc2_weight, fc2_bias, out_weight,
                     biases, eps: float, num_experts: int):
    """:func:`route_head` (with the skip class) as one Triton kernel each way where it runs and the router is at
    most ``HEAD_MAX_WIDTH`` wide; else the reference head with :func:`fused_route_top1`."""
    kernel = _kernel()
    params = (norm_weight, fc1_weight, fc1_bias, fc2_weight, fc2_bias, out_weight)
    if out_weight.shape[1] <= kernel.HEAD_MAX_WIDTH and kernel.runs_on(u, *params):
        return kernel.route_head(u, state_in, eda_scale, *params, biases, eps, num_experts)
    return route_head(u, state_in, eda_scale, *params, biases, eps, num_experts, route_top1=fused_route_top1)


# ----------------------------------------------------------------------------------------- the choice


def choose(config):
    """``(projection, head)`` for a router of ``config``. With the ``router`` op: the fp32-output GEMM for the
    projection and the fused top-1; with ``router_head`` too, the whole head in one kernel each way: ~100 fewer
    launches per layer step, and as tuned no more device time (docs/benchmarks.md, "One layer's launches"). The
    fused top-1 and head need the skip class."""
    if not config.uses_kernel("router"):
        return router_projection, route_head
    if not config.skip_class:
        return fused_router_projection, route_head
    if config.uses_kernel("router_head"):
        return fused_router_projection, fused_route_head
    return fused_router_projection, partial(route_head, route_top1=fused_route_top1)
