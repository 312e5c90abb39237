"""ZAYA1's MoE sublayer: Megatron's ``MoELayer`` (token dispatchers, experts) with the ZAYA1 router.

Megatron's ``MoELayer.forward(hidden, padding_mask=)`` has no room for the router state that ZAYA1 carries
from one MoE layer to the next (EDA, docs/architecture.md §4.2), so ``ZayaMoELayer.forward`` takes it as an
argument and returns the next one, handing it to the router around the unchanged Megatron forward.

A token that chooses the skip class goes to no expert, which Megatron's dropless alltoall dispatcher does not
expect (it sizes its permuted-token buffer as tokens × top-k); ``SkipAwareAlltoAllTokenDispatcher`` sizes it
by the routing map instead.

Top-1 without tensor parallelism and no shared experts, ``ZayaMoELayer`` dispatches by itself instead: a
stable sort of the tokens by expert (the skip class last), the experts on that static-size buffer with
device-side counts, and the inverse permutation back. That is Megatron's permutation, token for token, without
its host sync: Megatron sizes its permuted buffer by the routed count, which it must copy to the host in every
MoE layer, and a host-bound step (one ZAYA1-8B-width layer on an H200: 14 ms of host time for 6 ms of device
work) loses its lead over the device at every sync. With experts spread over EP ranks it does the same when
``--moe-token-dispatcher-type allgather`` is chosen: every rank gathers the EP group's tokens, sorts them with
other ranks' experts last, runs its experts, and a reduce-scatter sums each token's output (non-zero on its
expert's rank only) back to the token's rank. That moves EP× the tokens of an all-to-all, and needs no sync.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from ..ops import experts as experts_ops
from ..ops import moe as moe_ops
from ..runtime import say_once
from .module_hooks import call_module_hooks
from .norm import ResidualScaling, RMSNorm
from .recompute import recomputes


class SkipAwareAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """Megatron's alltoall dispatcher for routing maps with empty rows (tokens routed to the skip class).

    Dropless, Megatron permutes the first ``T·topk`` (expert, token) pairs of the map (token_dispatcher.py:550,
    moe_utils.py ``permute``), which for ``n`` skipped tokens adds ``n`` unrouted pairs to the buffer and breaks
    the split sizes. Here the buffer holds ``routing_map.sum()`` rows: the dynamic size Megatron itself uses
    with a capacity factor, copied to the host before the first permutation.
    """

    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
        tokens_per_expert = super().preprocess(routing_map)
        if not self.drop_and_pad:
            self.num_out_tokens = routing_map.sum()
            self._maybe_update_cuda_sync_point("before_permutation_1")
        return tokens_per_expert


class _PermuteRows(torch.autograd.Function):
    """``x[order]`` for a permutation ``order`` of x's rows, given with its ``inverse``. The backward gathers
    with the inverse instead of ``index_select``'s scatter-add (atomics into a zeroed buffer, ~5x slower)."""

    @staticmethod
    def forward(ctx, x, order, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class ZayaMoELayer(MoELayer):
    """``forward(x [s, b, D], router_state [s, b, R] | None) -> (out [s, b, D], next router_state)``."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, is_mtp_layer=False, name=None):
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        super().__init__(config, submodules, layer_number=layer_number, pg_collection=pg_collection,
                         is_mtp_layer=is_mtp_layer, name=name)
        if config.skip_class and type(self.token_dispatcher) is MoEAlltoAllTokenDispatcher:
            self.token_dispatcher = SkipAwareAlltoAllTokenDispatcher(
                self.num_local_experts, self.local_expert_indices, config=config, pg_collection=pg_collection
            )
        self.sort_by_expert = experts_ops.choose_sort(config)
        self.one_op = config.uses_kernel("moe") and self._one_op_fits()
        self._one_op_runs: dict[torch.device, bool] = {}

    def _one_op_fits(self) -> bool:
        """Whether this layout takes the ``moe`` op; says once why not where it does not."""
        if not self._dispatches_locally():
            say_once("the moe op runs the MoE sublayer of one rank's experts (EP 1, TP 1, top-1); this layout keeps "
                      "one op per kernel")
        elif not self.config.skip_class or self.experts.grouped is None:
            say_once("the moe op needs the skip class and the grouped experts; one op per kernel instead")
        else:
            return True
        return False

    def runs_as_one_op(self, hidden_states: torch.Tensor, merge: moe_ops.MergeAndNorm | None = None) -> bool:
        """Whether :meth:`forward` runs the sublayer as the ``moe`` op (recomputation included) on these inputs; with
        ``merge``, whether :meth:`forward_from_stream` does."""
        if not self.one_op:
            return False
        key = (hidden_states.device, merge is not None)
        if key not in self._one_op_runs:
            self._one_op_runs[key] = moe_ops.runs_on(
                hidden_states, self.router.weights(), *self.experts.weights(), self.experts.backends, merge)
        return self._one_op_runs[key]

    def takes_the_stream(self, attention_output: torch.Tensor, residual: torch.Tensor, merge, norm) -> bool:
        """Whether :meth:`forward_from_stream` runs: the ``moe`` op with ZAYA1's residual scaling and RMSNorm by their
        kernel (op ``residual``) on an fp32 stream, a skipped token giving 0 (``identity`` reads the norm's output
        outside the op)."""
        if not (self.one_op and self.config.uses_kernel("residual") and isinstance(merge, ResidualScaling)
                and isinstance(norm, RMSNorm) and self.config.skip_mode == "zero"):
            return False
        return self.runs_as_one_op(attention_output, _merge_and_norm(residual, merge, norm))

    def forward_from_stream(self, attention_output: torch.Tensor, residual: torch.Tensor, merge: ResidualScaling,
                            norm: RMSNorm, router_state: torch.Tensor | None = None):
        """The sublayer from the attention's output and the residual stream ``residual`` (fp32): the ``moe`` op merges
        the output into the stream (``merge``, the layer's ``self_attn_bda``) and normalises it (``norm``, its
        ``pre_mlp_layernorm``) first -> (output, the new stream, the next router state). Where
        :meth:`takes_the_stream`."""
        call_module_hooks(merge, norm)
        output, next_state, _, new_residual = self._one_op_forward(
            attention_output, router_state, _merge_and_norm(residual, merge, norm), norm.eps)
        return output, new_residual, next_state

    def forward(self, hidden_states: torch.Tensor, router_state: torch.Tensor | None = None):
        if self.runs_as_one_op(hidden_states):
            output, next_state, skip_gate, _ = self._one_op_forward(hidden_states, router_state)
        else:
            self.router.state_in = router_state
            if self._sorts_without_host_sync():
                output = self._sorted_forward(hidden_states)
            else:
                output, bias = super().forward(hidden_states)
                assert bias is None
            next_state, skip_gate = self.router.state_out, self.router.skip_gate
            self.router.state_in = self.router.state_out = self.router.skip_gate = None
        if self.config.skip_mode == "identity" and self.config.skip_class:
            # A skipped token passes through scaled by its (unbiased) skip probability.
            output = output + (skip_gate.view(hidden_states.shape[:-1]).unsqueeze(-1) * hidden_states.float()).to(
                output.dtype
            )
        return output, next_state

    def _one_op_forward(self, hidden_states: torch.Tensor, router_state: torch.Tensor | None,
                        merge: moe_ops.MergeAndNorm | None = None, norm_eps: float = 0.0):
        cfg = self.config
        recompute = next((name for name in ("moe", "router") if recomputes(cfg, name, self.training)), None)
        settings = moe_ops.Settings(cfg.layernorm_epsilon, self.num_local_experts, self.experts.backends, recompute,
                                    norm_eps, recomputes(cfg, "layernorm", self.training))
        call_module_hooks(self.router)  # its norm and EDA weights; weights() calls the rest
        output, next_state, skip_gate, _, new_residual = moe_ops.moe_sublayer(
            hidden_states, router_state, self.router.weights(), *self.experts.weights(), self.router.balancing_biases,
            settings, merge, self.router.tokens_per_class if self.router.counting() else None)
        return output, next_state, skip_gate, new_residual

    def _sorts_without_host_sync(self) -> bool:
        """Top-1, no tensor parallelism, no shared experts; every expert here, or the allgather dispatcher."""
        cfg = self.config
        no_tensor_parallel = all(group.size() == 1 for group in (self.tp_group, self.attn_tp_group,
                                                                  self.experts.tp_group))  # fmt: skip
        gathers = self.ep_group.size() == 1 or cfg.moe_token_dispatcher_type == "allgather"
        return (no_tensor_parallel and gathers and cfg.moe_router_topk == 1 and self.shared_experts is None
                and not cfg.moe_layer_recompute and not cfg.moe_apply_probs_on_input)

    def _dispatches_locally(self) -> bool:
        """The sync-free path with every expert on this rank: no collective inside the layer."""
        return self._sorts_without_host_sync() and self.ep_group.size() == 1

    def _sorted_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Route, sort the (EP group's) tokens by local expert, the rest last; run the experts, unsort. No host sync."""
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        probs, routing_map = self.router(hidden_states)  # [T, E] each, at most one expert per token
        prob = probs.sum(dim=-1)  # the chosen expert's probability, 0 for the skip class
        gathered = self.ep_group.size() > 1
        if gathered:  # the EP group's tokens [EP·T, ...]; the backward reduce-scatters their gradients
            tokens = gather_from_sequence_parallel_region(tokens, group=self.ep_group)
            prob = gather_from_sequence_parallel_region(prob, group=self.ep_group)
            with torch.no_grad():
                routing_map = gather_from_sequence_parallel_region(routing_map, group=self.ep_group)
        # Megatron's order: by expert, then by token (one rank: every expert is local).
        order, inverse, counts = self.sort_by_expert(routing_map, self.local_expert_indices[0], self.num_local_experts)
        output, bias = self.experts(_PermuteRows.apply(tokens, order, inverse), counts,
                                    _PermuteRows.apply(prob, order, inverse))
        assert bias is None
        output = _PermuteRows.apply(output, inverse, order)
        if gathered:  # one rank's output per token is non-zero: the bf16 sum is exact
            output = reduce_scatter_to_sequence_parallel_region(output, group=self.ep_group)
        return output.view(hidden_states.shape[:-1] + output.shape[-1:])


def _merge_and_norm(residual: torch.Tensor, merge: ResidualScaling, norm: RMSNorm) -> moe_ops.MergeAndNorm:
    return moe_ops.MergeAndNorm(residual, *merge.vectors, norm.weight)
