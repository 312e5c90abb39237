"""Waiting for background checkpoint writes within a deadline (what a SIGTERM leaves time for), on two gloo
ranks through Megatron's own async queue: past the deadline nothing is finalized and every rank says so alike;
given the time, the write is finalized."""

from __future__ import annotations

import argparse
import time

from gloo import run_ranks


def _finish_within(rank, world, write_seconds):
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.training import async_utils, global_vars

    from megatron_zaya.patches import apply_patches
    from megatron_zaya.training.checkpoint_tiers import finish_background_saves

    apply_patches("cpu")
    global_vars.set_args(argparse.Namespace(async_save=True, async_strategy="mcore", use_persistent_ckpt_worker=False))
    finalized = []
    async_utils.schedule_async_save(AsyncRequest(time.sleep, (write_seconds,), [lambda: finalized.append(rank)]))
    start = time.monotonic()
    in_time = finish_background_saves(0.2)
    waited, before = time.monotonic() - start, list(finalized)
    return in_time, waited, before, finish_background_saves(60), finalized


def test_a_write_in_flight_is_finalized_only_within_the_time_given(tmp_path):
    for rank, (in_time, waited, before, later, finalized) in enumerate(run_ranks(_finish_within, 2, tmp_path, 3.0)):
        assert not in_time and 0.2 <= waited < 2.0 and before == [], (in_time, waited, before)
        assert later and finalized == [rank]
