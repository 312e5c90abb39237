"""Composite ops: a sublayer as one autograd op whose backward is written by hand from its pieces' backwards.

Each piece is an existing ``torch.autograd.Function`` (a kernel's): :class:`Piece` runs its ``forward`` directly,
standing in for the ``ctx`` autograd would make, and later runs its ``backward`` with that context. The math is the
pieces' own; what goes is autograd's work per piece (a graph node, saved-tensor bookkeeping, a hook dispatch),
the host time of an eager layer that launches small kernels.
"""

from __future__ import annotations

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
