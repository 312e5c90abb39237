"""Patch group ``training_loop``: Megatron's training loop, on every platform."""

from __future__ import annotations

import functools
import gc

from .registry import register, replace_attr


@register("training_loop.frozen_setup_objects", target="megatron.training.training.train")
def frozen_setup_objects() -> None:
    """Python's garbage collector skips the objects that set-up built: ``train`` collects once, then freezes them.

    A full collection walks every tracked object: torch's, Megatron's, transformers' and the model's, about 0.7
    million in a ZAYA1-8B process, 0.3–0.4 s each on an H200 host. Python starts one whenever enough objects have
    survived younger collections, in the middle of a step, at a different moment on each rank. Frozen
    (``gc.freeze``), those objects are never walked again, so a collection walks only what the steps created;
    with ``--manual-gc`` (``--zaya-gc-interval``, on by default) Megatron also moves the collections to step
    boundaries. Off: leave ``training_loop.frozen_setup_objects`` out of ``--zaya-patches``.
    """
    import megatron.training.training as training

    original = training.train

    @functools.wraps(original)
    def train(*args, **kwargs):
        gc.collect()
        gc.freeze()
        return original(*args, **kwargs)

    replace_attr(training, "train", train)


@register("training_loop.gradient_ready_calls",
          target="megatron.core.distributed.distributed_data_parallel.DistributedDataParallel._make_backward_post_hook")
def gradient_ready_calls() -> None:
    """Each parameter under Megatron's DDP gets ``param.ddp_grad_ready()``: what DDP's backward hook does once a
    gradient is in ``main_grad`` (tell its bucket the gradient is ready, with ``--overlap-grad-reduce``).

    DDP hooks every parameter's gradient accumulator: autograd runs one node and one Python hook per parameter
    and micro-batch, 64 per ZAYA1 layer, although the sublayer ops (``moe``, ``cca_sublayer``) add their
    parameters' gradients into ``main_grad`` themselves. Given this call, those ops keep their parameters off
    autograd's graph and make it once per parameter in their backward (``ops.composite.hand_to_ddp``).
    Replaced: ``DistributedDataParallel._make_backward_post_hook`` (the hooks themselves are unchanged). Off: leave
    ``training_loop.gradient_ready_calls`` out of ``--zaya-patches``; the ops then return their gradients to
    autograd and DDP's hooks.
    """
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel

    original = DistributedDataParallel._make_backward_post_hook

    @functools.wraps(original)
    def _make_backward_post_hook(self, param):
        def ready():
            if self.ddp_config.overlap_grad_reduce and param in self.param_to_bucket_group:
                self.param_to_bucket_group[param].register_grad_ready(param, self.force_all_reduce)

        param.ddp_grad_ready = ready
        return original(self, param)

    replace_attr(DistributedDataParallel, "_make_backward_post_hook", _make_backward_post_hook)
