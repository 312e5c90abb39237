"""``benchmarks.timing.call_times``: each sample's time divided over its back-to-back calls, against a clock the
timed function itself advances (the CPU branch; on a GPU the same loop sits between two CUDA events)."""

from __future__ import annotations

import pytest

from benchmarks import timing


@pytest.mark.parametrize("calls", [1, 10])
def test_each_sample_is_the_time_per_call_of_its_calls(calls, monkeypatch):
    clock = [0.0]
    durations = iter([0.002, 0.004] * 100)  # seconds: calls alternate between 2 and 4 ms
    made = []

    def fn():
        made.append(1)
        clock[0] += next(durations)

    monkeypatch.setattr(timing.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    times = timing.call_times(fn, warmup=3, iters=2, calls=calls)
    assert len(made) == 3 + 2 * calls
    # one call per sample: the warm-up's 2, 4, 2 ms, then 4 and 2; ten per sample: 3 ms on average
    assert times == pytest.approx([4.0, 2.0] if calls == 1 else [3.0, 3.0])
