"""Tune a small kernel's per-platform launch table on this GPU: SwiGLU (``swiglu.SWIGLU_TUNING``), the router
epilogue (``router.ROUTER_TUNING``) or the fused router head (``router.ROUTER_HEAD_TUNING``).

    python -m benchmarks.tune_launch --kernel swiglu    # CUDA or ROCm GPU, about a minute each
    python -m benchmarks.tune_launch --kernel router
    python -m benchmarks.tune_launch --kernel router_head   # a few minutes: each setting compiles
    python -m benchmarks.tune_launch --kernel router_head --directions backward   # the backward only
    python -m benchmarks.tune_launch --kernel router --smoke    # tiny shapes, two settings a group: it runs

It times the kernel's ``bench_kernels.py`` cases (T = 4096 x ``--batch``) as CUDA-graph replays: the forward
launch by the forward time, the backward launch by the forward + backward time, summed over the cases. With
``--directions``, one of them is swept and the other keeps the table's setting.
``torch.compile`` of the reference is timed the same way first, as the baseline. It prints the best of each
group; copy them into the table.
"""

from __future__ import annotations

import argparse

import torch

from megatron_zaya.kernels import router, swiglu
from megatron_zaya.kernels.utils import platform

from .bench_kernels import SMOKE, Shapes, cases, time_passes, warm_up
from .timing import gpu_or_smoke, settings_grid, sweep_groups

# kernel: (its tuning table, the bench_kernels cases it is timed on, forward candidates, backward candidates)
TUNABLE = {
    "swiglu": (swiglu.SWIGLU_TUNING, ("swiglu", "swiglu_weighted"),
               settings_grid(rows=(1, 2, 4), block=(1024, 2048), warps=(4, 8, 16)),
               settings_grid(backward_rows=(1, 2, 4), backward_block=(1024, 2048), backward_warps=(4, 8, 16))),
    "router": (router.ROUTER_TUNING, ("router",),
               settings_grid(tokens=(16, 32, 64, 128, 256), warps=(1, 2, 4, 8)),
               settings_grid(backward_tokens=(16, 32, 64, 128, 256), backward_warps=(1, 2, 4, 8))),
    "router_head": (router.ROUTER_HEAD_TUNING, ("router_head",),
                    settings_grid(tokens=(16, 32, 64), warps=(4, 8), chunk=(32, 64), stages=(1, 2)),
                    settings_grid(backward_tokens=(16, 32), backward_warps=(4, 8), backward_chunk=(32, 64),
                                  backward_stages=(1, 2))),
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", choices=sorted(TUNABLE), default="swiglu")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--batch", type=int, default=2, help="T = 4096 x batch tokens")
    parser.add_argument("--directions", default="forward,backward",
                        help="the launches to sweep: forward, backward or both (the other keeps the table's setting)")
    args = parser.parse_args()
    if args.batch < 1:
        parser.error(f"--batch {args.batch}: need at least one sequence")
    directions = set(args.directions.split(","))
    if not directions <= {"forward", "backward"}:
        parser.error(f"--directions {args.directions}: give forward, backward or forward,backward")
    device = gpu_or_smoke("tune_launch.py", args.smoke)
    graph = device == "cuda"
    per_platform, case_names, forward, backward = TUNABLE[args.kernel]
    if args.smoke:  # a check that the sweep runs: under Triton's interpreter each setting takes seconds
        forward, backward = forward[:2], backward[:2]
    key = platform(torch.device(device))
    chosen = [c for c in cases(SMOKE if args.smoke else Shapes(batch=args.batch), device) if c.name in case_names]
    inputs = [(case, *case.make_inputs()) for case in chosen]
    if not args.smoke:
        for case, tensors, extra in inputs:
            compiled = torch.compile(case.reference)
            warm_up(compiled, tensors, extra)
            forward_ms, both_ms, _ = time_passes(compiled, tensors, extra, device, graph=graph)
            print(f"torch.compile {case.name}: forward {forward_ms:.4f} ms, forward + backward {both_ms:.4f} ms")
    print(f"platform {key}; current {per_platform[key]}")

    def measure(index: int):
        def total_ms() -> float:
            total = 0.0
            for case, tensors, extra in inputs:
                warm_up(case.kernel, tensors, extra)
                total += time_passes(case.kernel, tensors, extra, device, graph=graph)[index]
            return total
        return total_ms

    table = per_platform[key]
    best = sweep_groups(table, {"forward": forward}, measure(0)) if "forward" in directions else {}
    if "backward" in directions:  # timed forward + backward, each with the best forward launch (or the table's)
        best = sweep_groups(table, {"backward": [{**best, **setting} for setting in backward]}, measure(1))
    print(f"best (summed over {', '.join(case_names)}): {best}")


if __name__ == "__main__":
    main()
