"""What the benchmarks read from Megatron's training log: per-iteration time and loss, and the optimizer timer."""

from __future__ import annotations

import re

ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+).*?"
                       r"lm loss: ([0-9.E+-]+)")
# The timer block after each logged iteration (--timing-log-level >= 1): "optimizer ....: (min, max)" ms over ranks.
OPTIMIZER_TIMER = re.compile(r"^\s+optimizer \.+: \(([0-9.]+), ([0-9.]+)\)", re.MULTILINE)


def iterations(text: str) -> dict[int, tuple[float, float]]:
    """``{iteration: (ms, lm loss)}`` of a log, in log order."""
    return {int(i): (float(ms), float(loss)) for i, ms, loss in ITERATION.findall(text)}


def optimizer_ms(text: str) -> list[float]:
    """The optimizer step of each logged iteration, ms on the slowest rank, in log order."""
    return [float(high) for _, high in OPTIMIZER_TIMER.findall(text)]
