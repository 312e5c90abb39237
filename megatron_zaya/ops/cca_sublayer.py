"""ZAYA1's CCA sublayer up to its softmax attention on one rank's heads as one op (kernel op ``cca_sublayer``): the
input RMSNorm, the q, k and v projections, CCA's convolutions and epilogue, and the value delay, forward and backward
(docs/architecture.md §2-§3).

    x      = RMSNorm(r.to(dtype))                     # the fp32 residual stream r [s, b, D]
    q0, k0 = x Wqᵀ, x Wkᵀ                             # the plain matmuls of Megatron's linear layers at TP = 1
    q, k   = epilogue(convs(q0), convs(k0), q0, k0)   # skip terms, QK-norm, key temperature, RoPE
    v      = delay(x Wvᵀ)                             # its second half of channels one token later

It adds no math: the norm, the convolutions and the epilogue are the kernels that the layer runs without it
(ops ``residual`` and ``cca``), composed by :class:`~.composite.Piece`; the projections are the matmuls of
Megatron's ``ColumnParallelLinear``, and the delay ``ops.cca.delay_channels`` by its kernel (a shift, one launch
each way). Its backward is theirs in reverse order, the gradient of x summed in the order autograd sums it (v's,
k's, then q's), each added by its GEMM (an ``addmm``, rounded once) rather than by an addition after it. What goes
is autograd's work around a dozen ops (their graph nodes and saved-tensor bookkeeping, Megatron's TP = 1 mappings,
the delay's pads and concatenations) and the re-entrant autograd pass of the layer's selective recomputation: here
``recompute_norm`` (``layernorm``) keeps the residual stream but not x, and ``recompute_qk`` (``cca_qk``) keeps q0
and k0 but not the convolutions' outputs; the backward runs those pieces again (or :meth:`Run.qk_again` did, for a
layer that frees q and k until the backward, as it does without the op).
The attention and the output projection stay outside, as their own ops.

Under context parallelism the residual stream holds this rank's two chunks of the sequence, and the op exchanges
the rows before each chunk itself, as the layer does op by op: the convolutions' pre-conv q0 and k0 halos and the
previous token's delayed value channels, by one all-gather in the forward (their kernels read them in place), and
in the backward by the reduce-scatter that autograd runs for it, which returns each halo's gradient to the rank it
came from, added last into q0's, k0's or v's gradient as autograd adds it (``Settings.preceding_rows``: the model's
``context_parallel.PrecedingRows``).

Every parameter's gradient goes into Megatron's ``main_grad`` in fp32 where its DDP keeps one (the kernels' own for
theirs; the projections' as Megatron's gradient-accumulation fusion adds them), the op handing its parameters to DDP
itself, off autograd's graph (``composite.off_the_graph``); elsewhere autograd receives them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .composite import Piece, hand_to_ddp, off_the_graph, placeholders_unread


class CCAWeights(NamedTuple):
    """The parameters the op reads: the input norm's, the projections' ``[out, D]``, each convolution's (as
    ``model/cca.py`` holds them: depthwise ``[C, 1, t0]``, grouped ``[C, d, t1]``) and the key temperature."""

    norm_weight: torch.Tensor
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    v_weight: torch.Tensor
    q_depthwise_weight: torch.Tensor
    q_depthwise_bias: torch.Tensor
    q_grouped_weight: torch.Tensor
    q_grouped_bias: torch.Tensor
    k_depthwise_weight: torch.Tensor
    k_depthwise_bias: torch.Tensor
    k_grouped_weight: torch.Tensor
    k_grouped_bias: torch.Tensor
    key_temperature: torch.Tensor


@dataclass(frozen=True)
class Settings:
    """The op's arguments besides tensors: the norm's epsilon, the head size, the first value channel that comes
    from the previous token, what the backward recomputes (the norm's output; the convolutions' outputs), and under
    context parallelism what exchanges the rows before this rank's chunks: ``preceding_rows(locals_and_rows)``, the
    model's ``context_parallel.PrecedingRows`` of the context-parallel group (None without context parallelism)."""

    eps: float
    head_dim: int
    first_delayed: int
    recompute_norm: bool = False
    recompute_qk: bool = False
    preceding_rows: Callable | None = None


def _kernels():
    from ..kernels import cca, residual_rmsnorm  # triton only where the op runs

    return cca, residual_rmsnorm


def runs_on(residual: torch.Tensor, weights: CCAWeights, head_dim: int) -> bool:
    """Whether every piece runs as its kernel on these tensors: the norm on the fp32 stream, the convolutions on
    heads of a size they take, the epilogue; every weight in one dtype, that of the norm's output."""
    cca, norm = _kernels()
    return (residual.dtype == torch.float32 and len({w.dtype for w in weights}) == 1
            and residual.shape[-1] <= norm.MAX_HIDDEN and cca.takes_head_dim(head_dim)
            and norm.runs_on(residual, *weights) and cca.runs_on(residual, *weights))


def cca_sublayer(residual: torch.Tensor, weights: CCAWeights, cos: torch.Tensor, sin: torch.Tensor,
                 document_offsets: torch.Tensor | None, settings: Settings):
    """q, k and v for the attention from the residual stream ``residual [s, b, D]`` (fp32; this rank's two chunks
    under context parallelism); ``cos, sin [s, 1 or b, rot]`` of the RoPE angles (``ops.cca.rope_cos_sin``);
    ``document_offsets [s, b]`` int32 (packed documents: see ``ops.cca.causal_convs``) or None. Check
    :func:`runs_on` first.

    Returns: q ``[s, b, nq, d]``, k and v ``[s, b, nkv, d]`` in the weights' dtype; the residual stream passed
    through the op, for the layer to read from here on: the op's backward then adds the stream's gradient from
    there to the norm's in the norm's backward kernel, where autograd would add the two (an fp32 [s, b, D] sum);
    and the :class:`Run`, which can compute q and k again before the backward (:meth:`Run.qk_again`).
    """
    run = Run(settings)
    off_graph = weights if off_the_graph(weights) else None
    q, k, v, stream = CCASublayer.apply(run, residual, cos, sin, document_offsets, off_graph,
                                        *(() if off_graph else weights))
    return q, k, v, stream, run


class CCASublayer(torch.autograd.Function):
    """:func:`cca_sublayer`: ``(run, residual, cos, sin, document_offsets, off_graph, *weights)``, the weights either
    in ``off_graph``, which autograd does not see (their gradients go to DDP from the backward:
    :func:`~.composite.hand_to_ddp`), or as autograd's inputs."""

    @staticmethod
    def forward(ctx, run: Run, residual, cos, sin, document_offsets, off_graph, *weights):
        ctx.run, ctx.off_graph = run, off_graph
        ctx.set_materialize_grads(False)
        q, k, v = run.forward(residual, cos, sin, document_offsets, off_graph or CCAWeights(*weights))
        return q, k, v, residual.view_as(residual)

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v, grad_stream):
        run = ctx.run
        del ctx.run  # its tensors go with it
        with placeholders_unread(ctx.off_graph is not None):
            grad_residual, grad_weights = run.backward(grad_q, grad_k, grad_v, grad_stream)
        if ctx.off_graph is not None:
            hand_to_ddp(ctx.off_graph, grad_weights)
            grad_weights = ()
        return None, grad_residual, None, None, None, None, *grad_weights


class Run:
    """One call of the op: its pieces, kept from the forward for the backward."""

    def __init__(self, settings: Settings):
        self.settings = settings

    def forward(self, residual, cos, sin, offsets, weights: CCAWeights):
        """-> q, k, v as :func:`cca_sublayer` returns them, keeping what the backward needs and does not recompute."""
        cca, norm_kernel = _kernels()
        settings = self.settings
        self.weights, self.cos, self.sin, self.offsets = weights, cos, sin, offsets
        self.norm = Piece(norm_kernel.RMSNorm, residual, weights.norm_weight, settings.eps, True)
        x = self.norm.outputs.view(-1, residual.shape[-1])
        seq, batch = residual.shape[:2]
        self.q0, self.k0, v0 = ((x @ w.t()).view(seq, batch, -1)
                                for w in (weights.q_weight, weights.k_weight, weights.v_weight))
        v_previous = self._exchange_halos(v0)
        q, k = self._qk()
        if settings.recompute_qk:  # the epilogue's first two saved tensors are the convolutions' outputs
            self.epilogue.saved_tensors = (None, None, *self.epilogue.saved_tensors[2:])
        self.delay = Piece(cca.DelayChannels, v0, settings.first_delayed, v_previous, offsets)
        v = self.delay.outputs
        if settings.recompute_norm:
            self.norm = None  # the residual stream is the op's input: the backward normalises it again
            self.residual = residual
        heads = settings.head_dim
        return q.view(seq, batch, -1, heads), k.view(seq, batch, -1, heads), v.view(seq, batch, -1, heads)

    def _exchange_halos(self, v0):
        """Under context parallelism, the rows before each of this rank's two chunks, from the ranks that hold them
        (one all-gather, as the layer's op by op): the convolutions' pre-conv q0 and k0 halos, kept for them, and
        the previous token's delayed value channels, returned. Else None."""
        preceding_rows, self.halos, self.histories = self.settings.preceding_rows, None, (None, None)
        if preceding_rows is None:
            return None
        w = self.weights
        halo = (w.q_depthwise_weight.shape[-1] - 1) + (w.q_grouped_weight.shape[-1] - 1)
        self.halos = preceding_rows([(self.q0, halo), (self.k0, halo), (v0[..., self.settings.first_delayed:], 1)])
        q_history, k_history, v_previous = self.halos.preceding
        if halo:  # else the convolutions take no history, as op by op
            self.histories = q_history, k_history
        return v_previous

    def _qk(self, into=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolutions and the epilogue on q0 and k0: the pieces, and q, k ``[s, b, n·d]`` (written into
        ``into``'s q and k where given)."""
        cca, _ = _kernels()
        w = self.weights
        self.q_convs = Piece(cca.CausalConvs, self.q0, *w[4:8], self.histories[0], self.offsets)
        self.k_convs = Piece(cca.CausalConvs, self.k0, *w[8:12], self.histories[1], self.offsets)
        self.epilogue = Piece(cca.QKEpilogue, self.q_convs.outputs, self.k_convs.outputs, self.q0, self.k0,
                              w.key_temperature, self.cos, self.sin, self.settings.head_dim, into)
        return self.epilogue.outputs

    def qk_again(self, into: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k as the forward returned them, computed again into their storage ``into`` (the tensors the forward
        returned, refilled: no copy), and the convolutions' outputs with them for the backward: for a caller that
        frees q and k until the backward (the layer's ``cca_qk`` recomputation)."""
        self._qk(into)
        return into

    def backward(self, grad_q, grad_k, grad_v, grad_stream=None):
        """-> the residual stream's gradient (the norm's, plus ``grad_stream``, the passed-through stream's, where
        given) and one per weight (placeholders where added into ``main_grad``)."""
        cca, norm_kernel = _kernels()
        w, settings = self.weights, self.settings
        if self.epilogue.saved_tensors[0] is None:  # recompute_qk, and no qk_again since the forward
            self._qk()
        seq, batch, width = self.q0.shape[0], self.q0.shape[1], w.norm_weight.shape[0]
        grad_q, grad_k, grad_v = (_grad(grad, (seq, batch, weight.shape[0]), self.q0) for grad, weight in
                                  ((grad_q, w.q_weight), (grad_k, w.k_weight), (grad_v, w.v_weight)))
        grad_q_convs, grad_k_convs, grad_q0, grad_k0, d_temperature, *_ = self.epilogue.backward(grad_q, grad_k)
        # q0's (k0's) gradient: the epilogue's plus the convolutions', added by the convolutions' last kernel
        grad_k0, *d_k_convs, grad_k_history, _ = cca.CausalConvs.backward_adding(self.k_convs, grad_k_convs, grad_k0)
        grad_q0, *d_q_convs, grad_q_history, _ = cca.CausalConvs.backward_adding(self.q_convs, grad_q_convs, grad_q0)
        grad_v0, _, grad_v_previous, _ = self.delay.backward(grad_v)
        if self.halos is not None:  # the halos' gradients, back on the ranks they came from, added last as op by op
            self.halos.backward([grad_q_history, grad_k_history, grad_v_previous],
                                [grad_q0, grad_k0, grad_v0[..., settings.first_delayed:]])
        if self.norm is None:
            self.norm = Piece(norm_kernel.RMSNorm, self.residual, w.norm_weight, settings.eps, True)
        x = self.norm.outputs.view(-1, width)
        # v's, k's, q's: the order in which autograd runs the projections; k's and q's added into v's by their
        # GEMMs' epilogues (no addition of their own, one rounding each)
        grads = [g.reshape(-1, g.shape[-1]) for g in (grad_v0, grad_k0, grad_q0)]
        weights = (w.v_weight, w.k_weight, w.q_weight)
        grad_x = grads[0] @ weights[0]
        for grad, weight in zip(grads[1:], weights[1:]):
            grad_x.addmm_(grad, weight)
        d_v, d_k, d_q = _weight_grads(grads, x, weights)
        grad_residual, d_norm, _, _ = norm_kernel.RMSNorm.backward_adding(self.norm, grad_x.view(seq, batch, width),
                                                                          grad_stream)
        return grad_residual, (d_norm, d_q, d_k, d_v, *d_q_convs, *d_k_convs, d_temperature)


def _grad(grad: torch.Tensor | None, shape, like: torch.Tensor) -> torch.Tensor:
    """An output's gradient as ``[s, b, n·d]``; zeros for an output that got none."""
    return torch.zeros(shape, dtype=like.dtype, device=like.device) if grad is None else grad.reshape(shape)


def _weight_grads(grads, x, weights) -> list[torch.Tensor]:
    """The projections' weight gradients ``gradᵀ x``: added into each weight's ``main_grad`` in fp32 (placeholders
    returned), as Megatron's gradient-accumulation fusion adds them, where its DDP keeps one; else as Megatron's
    unfused linear layer returns them."""
    from ..kernels.utils import added_to_main_grad, main_grad_targets, matmul_fp32_into

    targets = main_grad_targets(weights)
    if targets is None:
        return [grad.t() @ x for grad in grads]
    for target, grad in zip(targets, grads):
        matmul_fp32_into(target, grad.t(), x, accumulate=True)
    return added_to_main_grad(weights)
