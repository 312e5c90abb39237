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
The whole router runs in fp32 whatever the parameter dtype. Its math is ``ops/router.py``: the projection, and
``route_head``, everything after it (EDA to top-1), which the kernels fuse into one kernel each way.

Balancing (§4.8): the router counts the tokens each class receives over all micro-batches of a step;
once per optimizer step :meth:`ZayaRouter.update_balancing_biases` takes an Adam step on the biases with
gradient ``share_e - 1/E`` (over-used experts are pushed down). The biases and their Adam moments are
persistent fp32 buffers, so they are checkpointed and survive ``Float16Module``'s cast.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule
from torch import nn

from ..ops import router as router_ops
from .module_hooks import call_module_hooks
from .recompute import Recompute, recomputes


class LinearWeights(nn.Module):
    """An ``nn.Linear``'s ``weight`` [out, in] and ``bias``, initialised as it initialises them, for a fused op to
    read: no forward of its own; :meth:`ZayaRouter.weights` runs its hooks (``module_hooks``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        linear = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
        self.weight, self.bias = linear.weight, linear.bias


class ZayaRouter(MegatronModule):
    """``MoESubmodules.router``: ``forward(hidden [s, b, D], padding_mask) -> (probs [T, E], map [T, E])``.

    The EDA state travels through the attributes ``state_in`` / ``state_out``, set and collected by
    ``ZayaMoELayer.forward`` around Megatron's ``MoELayer.forward`` (whose signature has no room for it).
    """

    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False):
        super().__init__(config=config)
        hidden, width, classes = config.hidden_size, config.router_hidden_size, config.num_router_classes
        self.num_experts = config.num_moe_experts
        self.down_proj = LinearWeights(hidden, width, bias=True, dtype=config.params_dtype)
        self.norm_weight = nn.Parameter(torch.ones(width, dtype=config.params_dtype))
        self.fc1 = LinearWeights(width, width, bias=True, dtype=config.params_dtype)
        self.fc2 = LinearWeights(width, width, bias=True, dtype=config.params_dtype)
        self.out_proj = LinearWeights(width, classes, bias=False, dtype=config.params_dtype)
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
        self.project, self.route_head = router_ops.choose(config)
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
        self.count(counts)
        return probs, routing_map

    def counting(self) -> bool:
        """Whether a forward adds its tokens per class to the step's: in training, not in a recomputation."""
        return self.training and self.count_tokens

    def count(self, counts: torch.Tensor) -> None:
        """Add a micro-batch's tokens per class ``[C]`` to the step's, where :meth:`counting`."""
        if self.counting():
            self.tokens_per_class += counts

    def weights(self) -> router_ops.RouterWeights:
        """The router's parameters, the hooks of each ``LinearWeights`` run first (``module_hooks``)."""
        down, fc1, fc2, out = self.down_proj, self.fc1, self.fc2, self.out_proj
        call_module_hooks(down, fc1, fc2, out)
        return router_ops.RouterWeights(down.weight, down.bias, self.eda_scale, self.norm_weight, fc1.weight, fc1.bias,
                                        fc2.weight, fc2.bias, out.weight)

    def _route(self, hidden_states: torch.Tensor, state_in: torch.Tensor | None):
        """-> probs, routing map, router state r_l, skip gate, tokens per class (see the module docstring)."""
        w = self.weights()
        u = self.project(hidden_states, w.down_weight, w.down_bias)
        return self.route_head(u, state_in, w.eda_scale, w.norm_weight, w.fc1_weight, w.fc1_bias, w.fc2_weight,
                               w.fc2_bias, w.out_weight, self.balancing_biases, self.config.layernorm_epsilon,
                               self.num_experts)

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
