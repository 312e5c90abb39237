"""Per-call wall time of a function on the GPU (CUDA events) or, without one, the CPU clock."""

from __future__ import annotations

import time

import torch


def call_times(fn, warmup: int, iters: int) -> list[float]:
    """Milliseconds of each of ``iters`` calls of ``fn`` after ``warmup`` untimed ones (device-synchronised)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
    return times
