"""ZAYA1's training recipe in the optimizer step: router freeze and expert gradient clipping.

Both act on the ``ChainedOptimizer`` that Megatron's ``get_megatron_optimizer`` returns (Adam or ZayaMuon, with or
without the distributed optimizer), through hooks rather than a copy of its step:

* **Expert clipping** (``--zaya-expert-clip-grad C``): after ``prepare_grads`` (the gradients the step will use
  are in place: ``.grad`` of the main parameters, or ``main_grad`` for ZayaMuon) the expert weights' norm over
  every rank is computed and, above C, their gradients are scaled down to C. Megatron's step then computes the
  global norm of the clipped gradients and applies ``--clip-grad`` to all of them.
* **Router freeze** (``--zaya-router-freeze-tokens N``): while fewer than N tokens have been consumed before a
  step, the router parameters' main copies are restored after each inner optimizer step (torch's step pre/post
  hooks). The optimizer state evolves as with a learning rate of 0 for them: the moments see the true gradients
  and the step count advances with every other parameter's (Megatron keeps one step per optimizer), so the
  routers thaw with well-formed moments; weight decay and the update never reach them. Restoring, not
  skipping, keeps the optimizer's state layout and checkpoints the same as without the flag.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import chain

import torch
from megatron.core.optimizer import clip_grads  # looked up when called: the cpu.clip_grads patch replaces it

from .muon import gradient_of


def is_expert(param: torch.Tensor) -> bool:
    """Megatron marks expert-parallel parameters (and copies the mark to their main copies) with allreduce=False."""
    return not getattr(param, "allreduce", True)


def _reads_main_grad(optimizer) -> bool:
    """ZayaMuon's wrappers step with ``main_grad`` (DDP's buffer), not ``.grad``."""
    from .megatron import _MuonWrapper

    return isinstance(optimizer, _MuonWrapper)


def _expert_params(optimizer) -> list[torch.Tensor]:
    return [p for p in optimizer.get_parameters() if is_expert(p)]


@torch.no_grad()
def expert_grad_norm(chained) -> float:
    """The expert weights' gradient norm over every rank, as each member optimizer reduces its statistics for
    Megatron's global norm (TP duplicates and shared weights left out, shards summed)."""
    squares = 0.0
    for optimizer in chained.chained_optimizers:
        if getattr(optimizer, "is_stub_optimizer", False):
            continue
        grads = optimizer._filter_grads_for_norm(optimizer.get_parameters(), param_filter=is_expert)
        norm = clip_grads.get_grad_norm_fp32(grads, grad_stats_parallel_group=optimizer.get_grad_stats_parallel_group())
        squares += float(norm) ** 2
    return math.sqrt(squares)


@torch.no_grad()
def clip_expert_grads(chained, max_norm: float) -> float:
    """Scale the expert weights' gradients so that their global norm is at most ``max_norm`` (Megatron's rule:
    factor ``max_norm / (norm + 1e-6)`` when below 1). Returns the norm before clipping."""
    norm = expert_grad_norm(chained)
    for optimizer in chained.chained_optimizers:
        params = [] if getattr(optimizer, "is_stub_optimizer", False) else _expert_params(optimizer)
        if not params:
            continue
        if _reads_main_grad(optimizer):
            factor = max_norm / (norm + 1.0e-6)
            if factor < 1.0:
                for grad in filter(lambda g: g is not None, map(gradient_of, params)):
                    grad.mul_(factor)
        else:
            clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=max_norm, total_norm=norm)
    return norm


def main_params_of(optimizer, model_params: set) -> list[torch.Tensor]:
    """The main (stepped) copies, on this rank, of the model parameters in ``model_params`` (compared by
    identity): fp32 masters or their distributed-optimizer shards, or the parameters themselves."""
    pairs = []
    for model_attr, main_attr in (("float16_groups", "fp32_from_float16_groups"),
                                  ("fp32_from_fp32_groups", "fp32_from_fp32_groups"),
                                  ("model_float16_groups", "shard_fp32_from_float16_groups"),
                                  ("model_fp32_groups", "shard_fp32_groups")):
        if hasattr(optimizer, model_attr):
            pairs += zip(chain.from_iterable(getattr(optimizer, model_attr)),
                         chain.from_iterable(getattr(optimizer, main_attr)))
    if not pairs:  # FP32Optimizer: it steps the model's parameters
        pairs = [(p, p) for p in optimizer.get_parameters()]
    ids = {id(p) for p in model_params}
    return [main for model, main in pairs if id(model) in ids and main is not None]


class RouterFreeze:
    """Keep ``params`` (the routers' parameters) as they are through every optimizer step begun while
    ``frozen()`` holds (see the module docstring); ``begin_step`` asks it once per step."""

    def __init__(self, chained, params: list[torch.Tensor], frozen: Callable[[], bool]):
        self.frozen, self.active = frozen, False
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        model_params = set(params)
        for optimizer in chained.chained_optimizers:
            if getattr(optimizer, "is_stub_optimizer", False):
                continue
            mains = main_params_of(optimizer, model_params)
            if mains:
                optimizer.optimizer.register_step_pre_hook(lambda *_, mains=mains: self._save(mains))
                optimizer.optimizer.register_step_post_hook(lambda *_: self._restore())

    def begin_step(self) -> None:
        self.active = self.frozen()

    def _save(self, mains: list[torch.Tensor]) -> None:
        self.saved = [(p, p.detach().clone()) for p in mains] if self.active else []

    def _restore(self) -> None:
        for param, value in self.saved:
            param.detach().copy_(value)
        self.saved = []


def install(chained, *, router_params: list[torch.Tensor] = (), frozen: Callable[[], bool] = lambda: False,
            expert_clip_grad: float = 0.0, on_expert_norm: Callable[[float], None] | None = None):
    """Add the recipe's hooks to ``chained`` (a ``ChainedOptimizer``) and return it.

    ``frozen()``, asked once per step, says whether that step leaves ``router_params`` as they are;
    ``expert_clip_grad`` > 0 clips the expert gradients before the global clip, and ``on_expert_norm``
    receives each step's expert norm before clipping."""
    freeze = RouterFreeze(chained, list(router_params), frozen) if router_params else None
    prepare_grads = chained.prepare_grads

    def prepare_grads_with_recipe() -> bool:  # the step's first call: its gradients are then ready
        if freeze is not None:
            freeze.begin_step()
        found_inf = prepare_grads()
        if not found_inf and expert_clip_grad > 0:
            norm = clip_expert_grads(chained, expert_clip_grad)
            if on_expert_norm is not None:
                on_expert_norm(norm)
        return found_inf

    chained.prepare_grads = prepare_grads_with_recipe
    return chained
