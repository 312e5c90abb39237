"""Where a training run waits for the GPU: ``python -m benchmarks.host_syncs -- ZAYA_PRETRAIN_FLAGS``.

Runs ``zaya-pretrain FLAGS`` in this process on one GPU and, from model forward ``--after`` + 1 on (the first
steps' compilation, tuning and CUDA-graph captures left out), counts every operation that makes the host wait for
the device: those ``torch.cuda.set_sync_debug_mode("warn")`` reports (``.item()``, a host tensor made from device
values, a size read back) and explicit ``torch.cuda.synchronize()`` calls. At exit it prints them grouped by the
Python frames that made them, most frequent first. Each wait costs an eager step the host's lead over the GPU.

Example (one GPU, a 4-layer proxy of ZAYA1-8B; two steps counted)::

    python -m benchmarks.host_syncs --after 8 -- --zaya-preset zaya1-8b --num-layers 4 --mock-data \\
        --seq-length 4096 --micro-batch-size 2 --global-batch-size 8 --train-iters 4 --bf16 --optimizer zaya_muon \\
        --use-distributed-optimizer --lr 3e-4 --lr-warmup-iters 1 --eval-iters 0
"""

from __future__ import annotations

import argparse
import sys
import traceback
import warnings
from collections import Counter

import torch

SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's message in sync debug mode "warn"


class Waits:
    """The waits seen while counting, by kind and stack (the innermost ``frames`` frames outside this module and
    ``warnings``)."""

    def __init__(self, frames: int = 8):
        self.frames, self.counting = frames, False
        self.by_place: Counter[tuple[str, str]] = Counter()

    def record(self, kind: str) -> None:
        if self.counting:
            stack = [f for f in traceback.extract_stack() if f.filename not in (__file__, warnings.__file__)]
            self.by_place[kind, "".join(traceback.format_list(stack[-self.frames:]))] += 1

    def showwarning(self, show):
        """``warnings.showwarning`` that records torch's sync warnings and passes the others to ``show``."""

        def showwarning(message, category, filename, lineno, file=None, line=None):
            if SYNC_WARNING in str(message):
                self.record("synchronizing op")
            else:
                show(message, category, filename, lineno, file, line)

        return showwarning

    def synchronize(self, synchronize):
        """``torch.cuda.synchronize`` that records each call."""

        def counted(*args, **kwargs):
            self.record("torch.cuda.synchronize")
            return synchronize(*args, **kwargs)

        return counted

    def report(self, top: int) -> None:
        kinds = Counter()
        for (kind, _), count in self.by_place.items():
            kinds[kind] += count
        print(f"[host-syncs] {sum(kinds.values())} waits in {len(self.by_place)} places: "
              + (", ".join(f"{count} {kind}" for kind, count in kinds.most_common()) or "none"), flush=True)
        for (kind, stack), count in self.by_place.most_common(top):
            print(f"[host-syncs] {count} x {kind}, at:\n{stack}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--after", type=int, default=8, help="model forwards left out before counting")
    parser.add_argument("--top", type=int, default=15, help="places listed")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="zaya-pretrain flags (after --)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_syncs.py needs a CUDA or ROCm GPU")
    from megatron_zaya import pretrain

    waits, forwards = Waits(), [0]

    def start_counting(module, inputs):
        if type(module).__name__ == "ZayaModel":
            forwards[0] += 1
            if forwards[0] == args.after + 1:
                waits.counting = True
                torch.cuda.set_sync_debug_mode("warn")

    warnings.simplefilter("always")
    warnings.showwarning = waits.showwarning(warnings.showwarning)
    torch.cuda.synchronize = waits.synchronize(torch.cuda.synchronize)
    torch.nn.modules.module.register_module_forward_pre_hook(start_counting)
    try:
        return pretrain.main([f for f in args.flags if f != "--"])
    finally:
        torch.cuda.set_sync_debug_mode("default")
        print(f"[host-syncs] counted from model forward {args.after + 1} of {forwards[0]}", flush=True)
        waits.report(args.top)


if __name__ == "__main__":
    sys.exit(main())
