"""Composite ops: a sublayer as one autograd op whose backward is written by hand from its pieces' backwards.

Each piece is an existing ``torch.autograd.Function`` (a kernel's): :class:`Piece` runs its ``forward`` directly,
standing in for the ``ctx`` autograd would make, and later runs its ``backward`` with that context. The math is the
pieces' own; what goes is autograd's work per piece (a graph node, saved-tensor bookkeeping, a hook dispatch),
the host time of an eager layer that launches small kernels.
"""

from __future__ import annotations

import contextlib

import torch


class Piece:
    """``Piece(Function, *args)``: ``Function.forward`` run on ``args`` with this object as its ``ctx``; its
    outputs are ``outputs``, and :meth:`backward` runs ``Function.backward`` with the tensors it saved. Every
    gradient is asked for: the composite op's backward takes what it needs."""

    def __init__(self, function: type[torch.autograd.Function], *args):
        self.function = function
        self.needs_input_grad = (True,) * len(args)
        self.saved_tensors: tuple = ()
        self.outputs = function.forward(self, *args)

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors) -> None:
        """Nothing to do: the composite op marks its own outputs."""

    def set_materialize_grads(self, value: bool) -> None:
        """Nothing to do: the composite op passes None for gradients that never came."""

    def backward(self, *grads) -> tuple:
        """``Function.backward`` of the saved context: the gradient of each forward argument (None for some)."""
        return self.function.backward(self, *grads)


def off_the_graph(params) -> bool:
    """Whether a composite op keeps ``params`` (None for an absent one) off autograd's graph, handing their gradients
    to Megatron's DDP itself (:func:`hand_to_ddp`): each is trained under DDP with its ready call (the
    ``training_loop.gradient_ready_calls`` patch), and kernels add gradients into ``main_grad``. Then no gradient
    accumulator node and no DDP hook runs per parameter and micro-batch."""
    from ..kernels.utils import ACCUMULATE_INTO_MAIN_GRAD  # triton only where the op runs

    return (ACCUMULATE_INTO_MAIN_GRAD["enabled"] and torch.is_grad_enabled()
            and all(p is None or p.requires_grad and hasattr(p, "ddp_grad_ready") for p in params))


@contextlib.contextmanager
def placeholders_unread(off_graph: bool):
    """Within, where ``off_graph``: the backward of a composite op whose parameters are off the graph
    (:func:`hand_to_ddp` takes their gradients): a kernel that adds a gradient into ``main_grad`` returns None for
    it, not a placeholder tensor (one allocation per parameter, and the experts' [E, M, K] placeholder of the
    grouped GEMM)."""
    from ..kernels.utils import GRADIENT_PLACEHOLDERS

    GRADIENT_PLACEHOLDERS["needed"] = not off_graph
    try:
        yield
    finally:
        GRADIENT_PLACEHOLDERS["needed"] = True


def hand_to_ddp(params, grads) -> None:
    """What DDP's hook does for each of ``params`` (None for an absent one) off the graph, with the gradient its
    piece returned: add one that its kernel did not add into ``main_grad`` itself, then tell DDP it is ready."""
    for param, grad in zip(params, grads, strict=True):
        if param is None:
            continue
        if not param.grad_added_to_main_grad:
            param.main_grad.add_(grad)
        param.ddp_grad_ready()
