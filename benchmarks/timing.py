"""Per-call wall time of a function on the GPU (CUDA events) or, without one, the CPU clock."""

from __future__ import annotations

import itertools
import time

import torch


def gpu_or_smoke(script: str, smoke: bool) -> str:
    """The device a benchmark runs on: ``cuda`` (CUDA or ROCm), or ``cpu`` for a ``--smoke`` check; else it exits."""
    if torch.cuda.is_available():
        return "cuda"
    if not smoke:
        raise SystemExit(f"{script} needs a CUDA or ROCm GPU; use --smoke to check the script on CPU")
    return "cpu"


def call_times(fn, warmup: int, iters: int, calls: int = 1) -> list[float]:
    """Milliseconds per call of ``fn`` in each of ``iters`` samples after ``warmup`` untimed calls. A sample is
    ``calls`` calls back to back, the device synchronised after the last: with one, each call starts on an idle
    device and waits for the host's first launches; with several, the host launches ahead as a training step's
    layers do, and a host slower than the device shows as a time above the device's."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / calls)
        else:
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append(1e3 * (time.perf_counter() - start) / calls)
    return times


def settings_grid(**choices) -> list[dict]:
    """Every combination of the choices: ``settings_grid(rows=(1, 2), warps=(4, 8))`` -> 4 dicts of rows and warps."""
    return [dict(zip(choices, values)) for values in itertools.product(*choices.values())]


def sweep_groups(table: dict, groups: dict[str, list[dict]], measure) -> dict:
    """Tune the launch-settings dict ``table`` in place, one group of its keys at a time.

    ``groups`` maps a group name to candidate settings (dicts of some of ``table``'s keys); each candidate is
    timed by ``measure()`` (milliseconds) with the other groups at the table's values. A candidate that fails
    (e.g. more shared memory than the chip has) is reported and skipped. ``table`` is restored; returns the best
    candidate of every group, merged.
    """
    original, best = dict(table), {}
    try:
        for group, candidates in groups.items():
            results = []
            for setting in candidates:
                table.update(original, **setting)
                try:
                    ms = measure()
                except Exception as error:  # a result, not a crash
                    print(f"{group}: {setting}: {type(error).__name__}: {str(error).splitlines()[0][:90]}")
                    continue
                results.append((ms, list(setting.items())))
                print(f"{group}: {setting}: {ms:.4f} ms", flush=True)
            best.update(min(results)[1])
    finally:
        table.clear()
        table.update(original)
    return best
