"""Tune the SwiGLU kernels' launch (``swiglu.SWIGLU_TUNING``) on this GPU.

    python benchmarks/tune_swiglu.py            # CUDA or ROCm GPU, about a minute
    python benchmarks/tune_swiglu.py --smoke    # tiny shapes, any device: checks the script runs

It times the ``swiglu`` and ``swiglu_weighted`` cases of ``bench_kernels.py`` (T = 4096 x ``--batch``,
F = 2048) as CUDA-graph replays: the forward launch by the forward time, the backward launch by the forward +
backward time, the sum over both cases. ``torch.compile`` of the reference is timed the same way first, as the
baseline. It prints the best of each group; copy them into ``SWIGLU_TUNING``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import SMOKE, Shapes, _time_passes, cases, warm_up  # noqa: E402
from timing import gpu_or_smoke, settings_grid, sweep_groups  # noqa: E402

from megatron_zaya.kernels import swiglu  # noqa: E402
from megatron_zaya.kernels.utils import platform  # noqa: E402

SWIGLU_CASES = ("swiglu", "swiglu_weighted")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--batch", type=int, default=2, help="T = 4096 x batch tokens")
    args = parser.parse_args()
    if args.batch < 1:
        parser.error(f"--batch {args.batch}: need at least one sequence")
    device = gpu_or_smoke("tune_swiglu.py", args.smoke)
    graph = device == "cuda"
    key = platform(torch.device(device))
    chosen = [c for c in cases(SMOKE if args.smoke else Shapes(batch=args.batch), device) if c.name in SWIGLU_CASES]
    inputs = [(case, *case.make_inputs()) for case in chosen]
    if not args.smoke:
        for case, tensors, extra in inputs:
            compiled = torch.compile(case.reference)
            warm_up(compiled, tensors, extra)
            forward, both, _ = _time_passes(compiled, tensors, extra, device, graph=graph)
            print(f"torch.compile {case.name}: forward {forward:.4f} ms, forward + backward {both:.4f} ms")
    print(f"platform {key}; current {swiglu.SWIGLU_TUNING[key]}")

    def measure(index: int):
        def total_ms() -> float:
            total = 0.0
            for case, tensors, extra in inputs:
                warm_up(case.kernel, tensors, extra)
                total += _time_passes(case.kernel, tensors, extra, device, graph=graph)[index]
            return total
        return total_ms

    table, original = swiglu.SWIGLU_TUNING[key], dict(swiglu.SWIGLU_TUNING[key])
    forward = settings_grid(rows=(1, 2, 4), block=(1024, 2048), warps=(4, 8, 16))
    backward = settings_grid(backward_rows=(1, 2, 4), backward_block=(1024, 2048), backward_warps=(4, 8, 16))
    best = sweep_groups(table, {"forward": forward}, measure(0))
    table.update(best)  # the backward group is timed forward + backward, with the best forward
    try:
        best.update(sweep_groups(table, {"backward": backward}, measure(1)))
    finally:
        table.clear()
        table.update(original)
    print(f"best (summed over {', '.join(SWIGLU_CASES)}): {best}")


if __name__ == "__main__":
    main()
