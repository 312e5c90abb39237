"""Activation recomputation: of whole layers (``--recompute-granularity full``, :func:`full_recompute_segments`) and
selectively of ZAYA1's cheap pieces (``--recompute-granularity selective``).

Full recomputation follows Megatron's ``--recompute-method`` and ``--recompute-num-layers`` N over a pipeline stage's
layers: ``uniform`` keeps only the input of each run of N layers and runs the whole run again in its backward;
``block`` recomputes the first N layers one by one and keeps the activations of the rest.

With selective recomputation, ``--recompute-modules`` names which pieces of every layer keep no activations of
their own: they run without autograd in the forward, keep only their inputs, and run again in the backward to get
their gradients (``config.RECOMPUTE_MODULES`` lists the names). A piece whose *output* is saved by the next operation (a norm's
output by the projections after it, CCA's attention output by ``linear_proj``) can also drop that output until
the backward reaches the sublayer: ``drop_outputs(hook_tensor)`` frees its storage and refills it, by
recomputation, when the gradient of ``hook_tensor`` (the sublayer's output) is computed, before any of the
sublayer's own backward runs. That is the idea of Megatron's ``CheckpointWithoutOutput``, which cannot serve
here: its recomputation refuses ``torch.autograd.grad`` (how the CUDA graphs of ``--zaya-cuda-graphs`` capture
a layer's backward) and reads the RNG state (not allowed during a capture). None of ZAYA1's recomputed pieces
draws random numbers (dropout is 0, and ``config.validate_zaya`` keeps it so under graphs), so this one does
not restore RNG state, and it hands the parameters' gradients back through autograd like any other operation:
recomputation inside a captured backward is captured too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def full_recompute_segments(layers: int, method: str, per_chunk: int) -> list[tuple[range, bool]]:
    """A stage's ``layers`` as consecutive runs, each with whether full recomputation (``--recompute-method``,
    ``--recompute-num-layers``) runs it from its input again in the backward."""
    if method == "uniform":
        return [(range(first, min(first + per_chunk, layers)), True) for first in range(0, layers, per_chunk)]
    return [(range(index, index + 1), index < per_chunk) for index in range(layers)]


def recomputes(config, name: str, active: bool = True) -> bool:
    """Whether piece ``name`` is recomputed (``active``: training with autograd on; eval keeps nothing anyway)."""
    return active and torch.is_grad_enabled() and name in getattr(config, "zaya_recompute_modules", ())


class Recompute:
    """``Recompute(fn, params)(*tensors)``: ``fn(*tensors)``'s outputs (a tensor or a tuple), keeping only
    ``tensors`` for the backward. ``params``: the parameters ``fn`` uses, whose gradients it returns."""

    def __init__(self, fn: Callable, params: Iterable[torch.nn.Parameter] = ()):
        self.fn = fn
        self.params = tuple(p for p in params if p.requires_grad)
        self.ctx = None
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.recomputed: tuple | None = None  # (leaves, outputs) of the recomputation

    def __call__(self, *tensors):
        outputs = _Recomputed.apply(self, len(tensors), *tensors, *self.params)
        single = not isinstance(outputs, tuple)
        self.outputs = (outputs,) if single else outputs
        return outputs

    def drop_outputs(self, hook_tensor: torch.Tensor, which: Iterable[int] = (0,)) -> None:
        """Free outputs ``which`` now (their consumers have saved them); refill them from a recomputation when
        the gradient of ``hook_tensor`` arrives. Every consumer's backward must run after that."""
        which = list(which)
        drop_until_gradient([self.outputs[i] for i in which], hook_tensor,
                            lambda: [self._recompute()[1][i] for i in which])

    def _recompute(self):
        if self.recomputed is None:
            leaves = [t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
                      for t in self.ctx.saved_tensors[: self.ctx.num_tensors]]
            with torch.enable_grad():
                outputs = self.fn(*leaves)
            self.recomputed = (leaves, outputs if isinstance(outputs, tuple) else (outputs,))
        return self.recomputed


def drop_until_gradient(outputs: list[torch.Tensor], hook_tensor: torch.Tensor,
                        recompute: Callable[[], Iterable[torch.Tensor]]) -> None:
    """Free ``outputs``' storage now (their consumers have saved them) and refill it with ``recompute()``'s tensors,
    the same outputs computed again, when the gradient of ``hook_tensor`` arrives. A ``recompute`` that writes into
    ``outputs`` themselves (their storage is back at its size when it runs) returns them, and nothing is copied."""
    sizes = [out.untyped_storage().nbytes() for out in outputs]
    for out in outputs:
        out.untyped_storage().resize_(0)

    def refill(grad):
        with torch.no_grad():
            for out, size in zip(outputs, sizes):
                out.untyped_storage().resize_(size)
            for out, fresh in zip(outputs, recompute(), strict=True):
                if fresh is out:
                    continue
                if out.stride() != fresh.stride() or out.storage_offset() != fresh.storage_offset():
                    raise RuntimeError("a recomputed output changed its layout; it cannot refill its storage")
                # storage-level copy: no version bump on a tensor that autograd has saved
                out.untyped_storage().copy_(fresh.untyped_storage())
        return grad

    hook_tensor.register_hook(refill)


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, region: Recompute, num_tensors: int, *tensors_and_params):
        tensors = tensors_and_params[:num_tensors]
        with torch.no_grad():
            outputs = region.fn(*tensors)
        ctx.region, ctx.num_tensors = region, num_tensors
        ctx.save_for_backward(*tensors)
        ctx.set_materialize_grads(False)
        region.ctx = ctx
        as_tuple = outputs if isinstance(outputs, tuple) else (outputs,)
        ctx.mark_non_differentiable(*(out for out in as_tuple if not out.is_floating_point()))
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        region = ctx.region
        leaves, outputs = region._recompute()
        region.ctx, region.recomputed, region.outputs = None, None, ()  # the recomputation is used once
        pairs = [(out, grad) for out, grad in zip(outputs, grads) if grad is not None and out.requires_grad]
        wanted = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad] + list(region.params)
        found = iter(torch.autograd.grad([out for out, _ in pairs], wanted, [grad for _, grad in pairs],
                                         allow_unused=True) if pairs and wanted else [None] * len(wanted))
        tensor_grads = [next(found) if isinstance(t, torch.Tensor) and t.requires_grad else None for t in leaves]
        return (None, None, *tensor_grads, *found)
