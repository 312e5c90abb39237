"""The ZAYA1 router: an MLP over a depth-averaged router state, top-1 with balancing biases (docs/architecture.md §4).

For the tokens x̂ of one MoE layer l (after its pre-MoE RMSNorm):

    u_l  = W_down x̂ + b_down                      # D -> R (R = router_hidden_size)
    r_l  = u_l + s_l ⊙ r_{l-1}                     # EDA; not on the first MoE layer; r_l goes to layer l+1
    z    = W3 GELU(W2 GELU(W1 RMSNorm(r_l) + b1) + b2)     # R -> E (+1 skip class)
    p    = softmax(z) in fp32
    e*   = argmax(p + b)                           # b: balancing biases, a buffer (no gradient)
    gate = p[e*]                                   # unbiased, not renormalised

A token whose choice is the skip class goes to no expert; its MoE output is 0 (ZAYA1-8B) or p_skip · x̂
(``skip_mode="identity"``, the ZAYA1-base fork), which ``ZayaMoELayer`` adds.
The whole router runs in fp32 whatever the parameter dtype. :func:`route_head` is everything after the
projection (EDA to top-1); ``kernels/router.py`` fuses it into one kernel each way.

Balancing (§4.8): the router counts the tokens each class receives over all micro-batches of a step;
once per optimizer step :meth:`ZayaRouter.update_balancing_biases` takes an Adam step on the biases with
gradient ``share_e - 1/E`` (over-used experts are pushed down). The biases and their Adam moments are
persistent fp32 buffers, so they are checkpointed and survive ``Float16Module``'s cast.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from torch import nn

from .norm import rms_norm
from .recompute import Recompute, recomputes


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


def router_ops(config):
    """``(router_projection, route_head)`` for a router of ``config``: with the ``router`` kernel op, the Triton
    kernels of ``kernels/router.py`` for the projection (a bf16 GEMM with fp32 output: the same products) and the
    top-1 (one pass over the logits); with ``router_head`` too, the whole head in one kernel each way: ~100
    fewer launches per layer step, more device time (docs/benchmarks.md, "One layer's launches"). Else the
    references above. The fused top-1 and head need the skip class."""
    if not config.uses_kernel("router"):
        return router_projection, route_head
    from ..kernels import router as kernels

    if not config.skip_class:
        return kernels.router_projection, route_head
    if config.uses_kernel("router_head"):
        return kernels.router_projection, kernels.route_head
    return kernels.router_projection, partial(route_head, route_top1=kernels.route_top1)


class ZayaRouter(MegatronModule):
    """``MoESubmodules.router``: ``forward(hidden [s, b, D], padding_mask) -> (probs [T, E], map [T, E])``.

    The EDA state travels through the attributes ``state_in`` / ``state_out``, set and collected by
    ``ZayaMoELayer.forward`` around Megatron's ``MoELayer.forward`` (whose signature has no room for it).
    """

    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False):
        super().__init__(config=config)
        hidden, width, classes = config.hidden_size, config.router_hidden_size, config.num_router_classes
        self.num_experts = config.num_moe_experts
        self.down_proj = nn.Linear(hidden, width, bias=True, dtype=config.params_dtype)
        self.norm_weight = nn.Parameter(torch.ones(width, dtype=config.params_dtype))
        self.fc1 = nn.Linear(width, width, bias=True, dtype=config.params_dtype)
        self.fc2 = nn.Linear(width, width, bias=True, dtype=config.params_dtype)
        self.out_proj = nn.Linear(width, classes, bias=False, dtype=config.params_dtype)
        # Every layer has the EDA scale so that Megatron can stack the layers' tensors in checkpoints; the
        # first MoE layer receives no router state, so its scale gets zero gradients (and stays at its init, 1).
        self.eda_scale = nn.Parameter(torch.ones(width, dtype=config.params_dtype)) if config.router_eda else None
        for param in self.parameters():
            # Under sequence parallelism each TP rank routes different tokens: sum the grads over TP.
            param.sequence_parallel = bool(config.sequence_parallel)

        biases = torch.zeros(classes, dtype=torch.float32)
        if config.skip_class:
            biases[-1] = config.skip_bias_init
        self.register_buffer("balancing_biases", biases)
        self.register_buffer("balancing_exp_avg", torch.zeros(classes, dtype=torch.float32))
        self.register_buffer("balancing_exp_avg_sq", torch.zeros(classes, dtype=torch.float32))
        self.register_buffer("balancing_step", torch.zeros((), dtype=torch.float32))
        # Tokens per class since the last bias update (all micro-batches of this step, this rank).
        self.register_buffer("tokens_per_class", torch.zeros(classes, dtype=torch.float32), persistent=False)
        self.project, self.route_head = router_ops(config)
        self.count_tokens = True  # off while a layer is recomputed for the backward pass
        self.state_in: torch.Tensor | None = None
        self.state_out: torch.Tensor | None = None
        self.skip_gate: torch.Tensor | None = None

    def set_layer_number(self, layer_number: int) -> None:
        """Megatron's router protocol; ZAYA1's router does not depend on its depth."""
        self.layer_number = layer_number

    def _apply(self, fn, recurse=True):
        # Keep the balancing buffers in fp32 when the module is cast (e.g. by Float16Module).
        fp32 = {k: v for k, v in self._buffers.items() if k.startswith(("balancing", "tokens_per"))}
        for name in fp32:
            del self._buffers[name]
        super()._apply(fn, recurse)
        for name, buf in fp32.items():
            self._buffers[name] = buf.to(device=fn(torch.empty(0, device=buf.device)).device)
        return self

    def forward(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None = None):
        if padding_mask is not None:
            raise NotImplementedError("ZAYA1 pretraining packs sequences without padding; padding_mask unsupported")
        route = Recompute(self._route, self.parameters()) if recomputes(self.config, "router", self.training) \
            else self._route
        probs, routing_map, self.state_out, self.skip_gate, counts = route(hidden_states, self.state_in)
        if self.training and self.count_tokens:
            self.tokens_per_class += counts.float()
        return probs, routing_map

    def _route(self, hidden_states: torch.Tensor, state_in: torch.Tensor | None):
        """-> probs, routing map, router state r_l, skip gate, tokens per class (see the module docstring)."""
        u = self.project(hidden_states, self.down_proj.weight, self.down_proj.bias)
        return self.route_head(u, state_in, self.eda_scale, self.norm_weight, self.fc1.weight, self.fc1.bias,
                               self.fc2.weight, self.fc2.bias, self.out_proj.weight, self.balancing_biases,
                               self.config.layernorm_epsilon, self.num_experts)

    @torch.no_grad()
    def update_balancing_biases(self, tokens_per_class: torch.Tensor) -> None:
        """One Adam step on the biases with gradient ``share - 1/E`` from global counts ``[C]``, its step size
        ramped over the first ``balancing_warmup_steps`` steps (counted by ``balancing_step``, which checkpoints
        keep: a resumed run continues the ramp)."""
        cfg = self.config
        balanced = slice(None) if cfg.balance_skip_class or not cfg.skip_class else slice(0, self.num_experts)
        counts = tokens_per_class[balanced].float()
        total = counts.sum()
        # A step that routed no token to these classes leaves the state as it is. Tensor ops only, no host
        # sync: this runs for every router in every step.
        routed = total > 0
        grad = counts / total.clamp_min(1) - 1.0 / counts.numel()
        beta1, beta2 = cfg.balancing_betas
        step = self.balancing_step + routed.float()
        m, v = self.balancing_exp_avg[balanced], self.balancing_exp_avg_sq[balanced]  # views
        new_m = m.mul(beta1).add_(grad, alpha=1 - beta1)
        new_v = v.mul(beta2).addcmul_(grad, grad, value=1 - beta2)
        # bias corrections in float64, rounded once, as Adam's Python-float formula does
        correction1, correction2 = ((1 - beta ** step.double()).float() for beta in (beta1, beta2))
        update = (new_m / correction1) / ((new_v / correction2).sqrt() + cfg.balancing_eps)
        self.balancing_step.copy_(step)
        m.copy_(torch.where(routed, new_m, m))
        v.copy_(torch.where(routed, new_v, v))
        biases = self.balancing_biases[balanced]
        if cfg.balancing_warmup_steps > 0:
            update = update * (step / cfg.balancing_warmup_steps).clamp(max=1.0)
        biases.copy_(torch.where(routed, biases - cfg.balancing_lr * update, biases))
