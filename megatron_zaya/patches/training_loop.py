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
