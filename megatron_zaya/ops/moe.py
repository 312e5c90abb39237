"""ZAYA1's MoE sublayer on one rank as one op (kernel op ``moe``): the residual merge and norm before it (where it
is given the residual stream), the router, the sort by expert, the experts with SwiGLU and the unsort, forward
and backward (docs/architecture.md §2, §4).

    x, r' = RMSNorm(merge(h, r)), merge(h, r)        # the attention's output h into the fp32 stream r
    u = x Wdᵀ + bd                                   # the router's projection, fp32 out
    probs, map, r, skip, counts = head(u, r_prev)    # EDA, RMSNorm, MLP, top-1 with the skip class
    order, inverse, per_expert = sort(map)           # tokens by expert, skipped tokens last
    y = experts(x[order], per_expert, probs.sum(-1)[order])
    out = y[inverse]

It adds no math: each step is the kernel that the layer runs without it (ops ``residual``, ``router``,
``router_head``, ``experts``), composed by :class:`~.composite.Piece`, and its backward is their backwards in
reverse order. So its reference is theirs, composed as ``ZayaMoELayer`` composes them with the op off. What goes
is autograd's work around eight kernel ops (their graph nodes and saved-tensor bookkeeping), most row permutations
(the grouped GEMM kernels read x, write y and x's gradient in token order through the sort's order: no sorted x or
y is kept for the backward, which sorts y's gradient and x once each for the weight gradients), and the
re-entrant autograd passes of the selective recomputation: here the backward normalises the stream again
(``recompute_norm``: x is not kept), recomputes the router's projection (``recompute="router"``: the fused head
recomputes the rest in its backward kernel anyway) or the whole forward (``recompute="moe"``) by running the pieces
again. A grouped GEMM on ``torch._grouped_mm`` (``ops/grouped_mm.py``), which cannot gather, permutes its rows by
``index_select``.

The parameters' gradients go into Megatron's ``main_grad``: the kernels add theirs (the experts', from the grouped
GEMM), and under DDP the op hands its parameters to DDP itself, off autograd's graph (``composite.off_the_graph``);
elsewhere autograd receives them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import grouped_mm
from .composite import Piece, hand_to_ddp, off_the_graph, placeholders_unread
from .router import RouterWeights


@dataclass(frozen=True)
class Settings:
    """The op's arguments besides tensors: the router's RMSNorm epsilon, the number of experts, the backends of
    fc1's and fc2's grouped GEMMs (``ops/grouped_mm.py``), what the backward recomputes: None, ``router`` (the
    projection u) or ``moe`` (everything; only the inputs and the router state are kept); and for an op given the
    residual stream (:class:`MergeAndNorm`), the norm's epsilon and whether its output x is normalised again in the
    backward instead of kept (``layernorm`` recomputation)."""

    eps: float
    num_experts: int
    backends: tuple[grouped_mm.Backends, grouped_mm.Backends] = (grouped_mm.TRITON, grouped_mm.TRITON)
    recompute: str | None = None
    norm_eps: float = 1e-5
    recompute_norm: bool = False


class MergeAndNorm(NamedTuple):
    """The residual stream ``residual [..., D]`` (fp32), the merge's vectors (β_h, α_h, β_r, α_r) and the norm's
    weight: the op merges its input (the attention's output) into the stream and normalises it first
    (``ops/residual_norm.py``)."""

    residual: torch.Tensor
    hidden_bias: torch.Tensor
    hidden_scale: torch.Tensor
    residual_bias: torch.Tensor
    residual_scale: torch.Tensor
    norm_weight: torch.Tensor


def _kernels():
    from ..kernels import grouped_gemm, residual_rmsnorm, router, sort_by_expert, swiglu  # triton where the op runs

    return grouped_gemm, router, sort_by_expert, swiglu, residual_rmsnorm


def runs_on(hidden: torch.Tensor, router: RouterWeights, fc1, fc2, backends, merge: MergeAndNorm | None = None) -> bool:
    """Whether every piece runs as its kernel on these tensors: the merge and norm (on an fp32 stream, where given),
    the router head up to its width, the sort, SwiGLU and both grouped GEMMs (or their ``torch._grouped_mm``
    backends), with the weights in the input's dtype."""
    grouped_gemm, router_kernel, sort_kernel, swiglu, norm = _kernels()
    router_weights = [w for w in router if w is not None]
    vectors = () if merge is None else merge[1:]
    if any(w.dtype != hidden.dtype for w in (*router_weights, *fc1, *fc2, *vectors)):
        return False
    if router.out_weight.shape[1] > router_kernel.HEAD_MAX_WIDTH:
        return False
    if merge is not None and (merge.residual.dtype != torch.float32 or hidden.shape[-1] > norm.MAX_HIDDEN
                              or not norm.runs_on(hidden, *merge)):
        return False
    return (router_kernel.runs_on(hidden, *router_weights) and sort_kernel.runs_on(hidden) and swiglu.runs_on(hidden)
            and all(grouped_gemm.runs_on(hidden, *weights) if chosen == grouped_mm.TRITON
                    else grouped_mm.runs_on(hidden, weights, chosen)
                    for weights, chosen in zip((fc1, fc2), backends)))


def moe_sublayer(hidden: torch.Tensor, state_in: torch.Tensor | None, router: RouterWeights, fc1, fc2,
                 biases: torch.Tensor, settings: Settings, merge: MergeAndNorm | None = None,
                 counts_into: torch.Tensor | None = None):
    """The MoE sublayer on ``hidden [..., D]``, with the previous MoE layer's router state ``state_in [..., R]`` (None
    on the first), the router's weights, the experts' ``fc1`` and ``fc2`` (lists of ``[2F, D]`` and ``[D, F]``) and
    the balancing ``biases [E + 1]``; given ``merge``, ``hidden`` is the attention's output, merged into the stream
    and normalised first; given ``counts_into`` (the step's tokens per class), the forward adds its counts into it
    (a recomputation does not). Check :func:`runs_on` first.

    Returns: the output ``[..., D]`` in hidden's dtype, the router state ``[..., R]`` fp32, the skip gate ``[T]``
    fp32 (p_skip where the skip class won, else 0), the tokens per class ``[E + 1]`` (int64; ``counts_into`` where
    given), and the new residual stream, shaped as ``hidden`` (None without ``merge``).
    """
    weights = (*router, *fc1, *fc2) if merge is None else (*merge[1:], *router, *fc1, *fc2)
    off_graph = off_the_graph(weights)
    residual = None if merge is None else merge.residual
    out, state, skip_gate, counts, new_residual = MoESublayer.apply(
        settings, len(fc1), hidden, residual, state_in, biases, counts_into, weights if off_graph else None,
        *(() if off_graph else weights))
    return out.view(hidden.shape), state.view(*hidden.shape[:-1], state.shape[-1]), skip_gate, counts, new_residual


class MoESublayer(torch.autograd.Function):
    """:func:`moe_sublayer`: ``(settings, num_experts, hidden, residual, state_in, biases, counts_into, off_graph,
    *weights)``, the weights (``*merge[1:]`` where the residual stream is given, ``*router, *fc1, *fc2``) either in
    ``off_graph``, a tuple autograd does not see (their gradients go to DDP from the backward:
    :func:`~.composite.hand_to_ddp`), or as autograd's inputs."""

    @staticmethod
    def forward(ctx, settings: Settings, num_experts: int, hidden, residual, state_in, biases, counts_into, off_graph,
                *weights):
        ctx.off_graph = off_graph
        weights = off_graph or weights
        merged = 0 if residual is None else len(MergeAndNorm._fields) - 1
        merge, weights = weights[:merged], weights[merged:]
        router = RouterWeights(*weights[: len(RouterWeights._fields)])
        fc1, fc2 = weights[len(router): len(router) + num_experts], weights[len(router) + num_experts:]
        run = _Forward(settings, hidden, residual, merge, state_in, biases, router, fc1, fc2, counts_into)
        ctx.hidden_shape, ctx.state_shape = hidden.shape, None if state_in is None else state_in.shape
        if settings.recompute == "moe":
            ctx.save_for_backward(hidden, residual, state_in, biases)
            ctx.recompute = (settings, merge, router, fc1, fc2)
        else:
            ctx.run = run
        ctx.mark_non_differentiable(run.counts)
        ctx.set_materialize_grads(False)
        return run.out, run.state, run.skip_gate, run.counts, run.new_residual

    @staticmethod
    def backward(ctx, grad_out, grad_state, grad_skip, _grad_counts, grad_new_residual):
        if hasattr(ctx, "run"):
            run = ctx.run
            del ctx.run  # its saved tensors go with it
        else:
            hidden, residual, state_in, biases = ctx.saved_tensors
            settings, merge, router, fc1, fc2 = ctx.recompute
            run = _Forward(settings, hidden, residual, merge, state_in, biases, router, fc1, fc2)
        if grad_out is None:
            grad_out = torch.zeros_like(run.out)
        with placeholders_unread(ctx.off_graph is not None):
            grad_hidden, grad_residual, grad_state_in, grad_merge, grad_router, grad_fc1, grad_fc2 = run.backward(
                grad_out.reshape(run.out.shape), grad_state, grad_skip, grad_new_residual)
        if grad_state_in is not None:
            grad_state_in = grad_state_in.view(ctx.state_shape)
        grads = (*grad_merge, *grad_router, *grad_fc1, *grad_fc2)
        if ctx.off_graph is not None:
            hand_to_ddp(ctx.off_graph, grads)
            grads = ()
        return (None, None, grad_hidden.view(ctx.hidden_shape), grad_residual, grad_state_in, None, None, None,
                *grads)


class _Forward:
    """One forward's pieces, kept for its backward."""

    def __init__(self, settings: Settings, hidden, residual, merge, state_in, biases, router: RouterWeights, fc1,
                 fc2, counts_into=None):
        _, router_kernel, sort_kernel, swiglu, norm_kernel = _kernels()
        self.router, self.new_residual, self.norm = router, None, None
        if residual is not None:
            self.norm_arguments = (hidden, residual, *merge, settings.norm_eps)
            self.norm = Piece(norm_kernel.ResidualRMSNorm, *self.norm_arguments)
            hidden, self.new_residual = self.norm.outputs
        hidden2d = hidden.reshape(-1, hidden.shape[-1])
        # The projection without its bias, which the head adds: two fewer launches, the same sums
        self.projection = Piece(router_kernel.RouterProjection, hidden2d, router.down_weight, None)
        head_arguments = router_kernel.route_head_arguments(
            self.projection.outputs, state_in, router.eda_scale, router.norm_weight, router.fc1_weight,
            router.fc1_bias, router.fc2_weight, router.fc2_bias, router.out_weight, biases, settings.eps,
            settings.num_experts, router.down_bias, counts_into)
        self.head = Piece(router_kernel.RouteHead, *head_arguments)
        probs, routing_map, self.state, self.skip_gate, self.counts = self.head.outputs
        if settings.recompute == "router":  # u, the head's first saved tensor, is dropped and recomputed
            assert self.head.saved_tensors[0] is head_arguments[0]
            self.head.saved_tensors = (None, *self.head.saved_tensors[1:])
        # each token's gate (the one entry of its probs that is not 0; op by op, their sum) in sorted order
        self.order, self.inverse, per_expert, prob = sort_kernel.sort_by_expert(routing_map, 0, settings.num_experts,
                                                                                 probs)
        # fc1 reads x in token order and fc2 writes its output in token order (the kernels through the sort's order)
        token_order = grouped_mm.TokenOrder(self.order, self.inverse)
        self.fc1 = _grouped_gemm(hidden2d, fc1, per_expert, settings.backends[0], x_order=token_order)
        self.swiglu = Piece(swiglu.SwiGLU, self.fc1.outputs, prob.unsqueeze(-1), None)
        self.fc2 = _grouped_gemm(self.swiglu.outputs, fc2, per_expert, settings.backends[1], out_order=token_order)
        self.out = self.fc2.outputs
        if self.norm is not None and settings.recompute_norm:  # x, saved by the projection and fc1, normalised again
            for piece in (self.projection, self.fc1):
                piece.saved_tensors = (None, *piece.saved_tensors[1:])
            self.norm.outputs = ()

    def backward(self, grad_out, grad_state, grad_skip, grad_new_residual):
        """-> the gradients of the input rows, of the residual stream (None without it), of the router state in, of
        the merge's vectors and the norm's weight (none without them), of the router's weights (as
        :class:`RouterWeights`), and of fc1's and fc2's weights (placeholders where a kernel added them into
        ``main_grad``)."""
        _, router_kernel, _, _, norm_kernel = _kernels()
        if self.projection.saved_tensors[0] is None:
            x = Piece(norm_kernel.ResidualRMSNorm, *self.norm_arguments).outputs[0]
            x = x.reshape(-1, x.shape[-1])
            for piece in (self.projection, self.fc1):
                piece.saved_tensors = (x, *piece.saved_tensors[1:])
        if self.head.saved_tensors[0] is None:
            hidden2d = self.projection.saved_tensors[0]
            u = Piece(router_kernel.RouterProjection, hidden2d, self.router.down_weight, None).outputs
            self.head.saved_tensors = (u, *self.head.saved_tensors[1:])
        grad_act, grad_fc2 = _grouped_gemm_backward(self.fc2, grad_out)
        grad_h, grad_prob, _ = self.swiglu.backward(grad_act)
        grad_x, grad_fc1 = _grouped_gemm_backward(self.fc1, grad_h)
        n_tokens, n_experts = self.head.outputs[0].shape
        # broadcast over the experts, as autograd hands the gates' sum its gradient; the head reads it by strides
        grad_probs = grad_prob.view(-1).index_select(0, self.inverse).unsqueeze(-1).expand(n_tokens, n_experts)
        grad_u, grad_state_in, d_eda, d_norm, d_w1, d_b1, d_w2, d_b2, d_w3, _, _, d_down_bias, _ = self.head.backward(
            grad_probs, None, grad_state, grad_skip, None)
        # the projection's gradient of x added into the experts' by its GEMM
        grad_hidden, d_down_weight, _ = router_kernel.RouterProjection.backward_adding(self.projection, grad_u, grad_x)
        d_router = RouterWeights(d_down_weight, d_down_bias, d_eda, d_norm, d_w1, d_b1, d_w2, d_b2, d_w3)
        grad_residual, d_merge = None, ()
        if self.norm is not None:
            if grad_new_residual is None:
                grad_new_residual = torch.zeros_like(self.new_residual)
            hidden = self.norm_arguments[0]
            grad_hidden, grad_residual, *d_merge, _ = self.norm.backward(grad_hidden.view(hidden.shape),
                                                                         grad_new_residual)
        return grad_hidden, grad_residual, grad_state_in, d_merge, d_router, grad_fc1, grad_fc2


def _grouped_gemm(x, weights, per_expert, backends: grouped_mm.Backends, x_order=None, out_order=None) -> Piece:
    """The grouped GEMM over tokens sorted by expert (a zero tail), by the Triton kernel or ``torch._grouped_mm``
    as ``backends`` name; x's or the output's rows in token order where their ``TokenOrder`` is given."""
    function, arguments = grouped_mm.autograd_call(x, weights, per_expert, True, backends, x_order, out_order)
    return Piece(function, *arguments)


def _grouped_gemm_backward(gemm: Piece, grad_out) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """-> the input's gradient and one gradient per expert weight (a stacked weight's, unbound)."""
    grads = gemm.backward(grad_out)
    grad_weights = list(grads[-len(gemm.weights):])  # the Functions' last arguments are their weights
    if gemm.weights[0].dim() == 3:  # the experts' weights, stacked into one tensor by ``prepare``
        grad_weights = list(grad_weights[0].unbind(0))
    return grads[0], grad_weights
