"""Tune the RMSNorm / residual kernels' backward launch (``residual_rmsnorm.BACKWARD_TUNING``) on this GPU.

    python -m benchmarks.tune_norm_backward            # CUDA or ROCm GPU, about a minute
    python -m benchmarks.tune_norm_backward --smoke    # tiny shapes, any device: checks the script runs

For every (rows per iteration, programs per SM, warps, pipeline depth) it times forward + backward of the four
norm cases of ``bench_kernels.py`` (rmsnorm, residual_rmsnorm, residual_norm, residual_merge at T = 4096 x
``--batch``, D = 2048) as
CUDA-graph replays, prints their effective bandwidth as a share of a [T, D] copy timed the same way, and
the configuration with the best geometric mean over the four. Copy that row into ``BACKWARD_TUNING``.
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch

from megatron_zaya.kernels import residual_rmsnorm
from megatron_zaya.kernels.utils import platform

from .bench_kernels import SMOKE, Shapes, cases, median_ms, time_passes
from .timing import gpu_or_smoke

NORM_CASES = ("rmsnorm", "residual_rmsnorm", "residual_norm", "residual_merge")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rows", default="1,2,4")
    parser.add_argument("--programs-per-sm", default="2,4,8")
    parser.add_argument("--warps", default="0,4,8,16", help="0: the kernel's default from the row width")
    parser.add_argument("--stages", default="1,2", help="software-pipeline depths of the row loop")
    parser.add_argument("--batch", type=int, default=2, help="T = 4096 x batch tokens")
    args = parser.parse_args()
    if args.batch < 1:
        parser.error(f"--batch {args.batch}: need at least one sequence")
    device = gpu_or_smoke("tune_norm_backward.py", args.smoke)
    shapes = SMOKE if args.smoke else Shapes(batch=args.batch)
    graph = device == "cuda"
    key = platform(torch.device(device))
    x = torch.randn(shapes.tokens, shapes.hidden, device=device).to(torch.bfloat16)
    y = torch.empty_like(x)
    copy_gbs = 4 * x.numel() / median_ms(lambda: y.copy_(x), device, graph) / 1e6
    print(f"platform {key}; copy [T, D] bf16: {copy_gbs:.0f} GB/s; current {residual_rmsnorm.BACKWARD_TUNING[key]}")
    chosen = {c.name: c for c in cases(shapes, device) if c.name in NORM_CASES}
    inputs = {name: case.make_inputs() for name, case in chosen.items()}
    original = dict(residual_rmsnorm.BACKWARD_TUNING[key])
    results = []
    grid = itertools.product(*(map(int, a.split(",")) for a in (args.rows, args.programs_per_sm, args.warps,
                                                                args.stages)))
    for rows, per_sm, warps, stages in grid:
        residual_rmsnorm.BACKWARD_TUNING[key] = {**original, "rows": rows, "programs_per_sm": per_sm,
                                                 "num_warps": warps or None, "stages": stages}
        shares = {}
        try:
            for name, case in chosen.items():
                tensors, extra = inputs[name]
                _, ms, _ = time_passes(case.kernel, tensors, extra, device, graph=graph)
                shares[name] = sum(case.bytes) / ms / 1e6 / copy_gbs
        except Exception as error:  # e.g. more shared memory than the chip has: a result, not a crash
            print(f"rows {rows} programs/SM {per_sm} warps {warps or 'auto'} stages {stages}: "
                  f"{type(error).__name__}: {str(error).splitlines()[0][:90]}", flush=True)
            continue
        mean = math.exp(sum(map(math.log, shares.values())) / len(shares))
        results.append((mean, rows, per_sm, warps, stages, shares))
        print(f"rows {rows} programs/SM {per_sm} warps {warps or 'auto':>4} stages {stages}: "
              + " ".join(f"{n} {s:6.1%}" for n, s in shares.items()) + f" | geo-mean {mean:6.1%}", flush=True)
    residual_rmsnorm.BACKWARD_TUNING[key] = original
    mean, rows, per_sm, warps, stages, shares = max(results, key=lambda r: r[0])
    print(f"best: {{'rows': {rows}, 'programs_per_sm': {per_sm}, 'num_warps': {warps or None}, 'stages': {stages}}} "
          f"geo-mean {mean:.1%} of copy (fwd+bwd): " + ", ".join(f"{n} {s:.1%}" for n, s in shares.items()))


if __name__ == "__main__":
    main()
