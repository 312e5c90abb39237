"""``probe.idle_between`` (profile_layer's ``--gaps``) against a brute-force reference: the device's timeline
sampled at every microsecond, each idle microsecond charged to the kernel pair around it."""

from __future__ import annotations

import random
from collections import defaultdict

from benchmarks.probe import busy_ms, idle_between


def sampled_idle(kernels):
    """Idle µs between the first kernel's start and the last end, by (latest-ending kernel so far, next to start)."""
    idle = defaultdict(float)
    ordered = sorted(kernels)
    end_of_all = max(end for _, end, _ in ordered)
    for t in range(int(ordered[0][0]), int(end_of_all)):
        if any(start <= t < end for start, end, _ in ordered):
            continue
        ran = [k for k in ordered if k[1] <= t]
        last = max(ran, key=lambda k: (k[1], -ordered.index(k)))[2]
        following = next(name for start, _, name in ordered if start > t)
        idle[last, following] += 1
    return dict(idle)


def test_idle_between_matches_the_sampled_timeline():
    rng = random.Random(0)
    names = ["gemm", "norm", "sort", "attention"]
    for _ in range(20):
        kernels, t = [], 0
        for _ in range(12):
            t += rng.choice([0, 0, 3, 7]) - rng.choice([0, 2])  # overlaps, back to back, and gaps
            length = rng.randint(1, 9)
            kernels.append((t, t + length, rng.choice(names)))
            t += length
        idle = idle_between(kernels)
        assert idle == sampled_idle(kernels)
        span = max(e for _, e, _ in kernels) - min(s for s, _, _ in kernels)
        assert sum(idle.values()) == span - busy_ms([(s, e) for s, e, _ in kernels]) * 1e3
