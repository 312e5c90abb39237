"""Tune the grouped expert GEMM's launch settings (``grouped_gemm.GEMM_TUNING``) on this GPU.

    python -m benchmarks.tune_grouped_gemm            # CUDA or ROCm GPU, one to two minutes
    python -m benchmarks.tune_grouped_gemm --smoke    # tiny shapes, any device: checks the script runs

Times forward + backward of both expert GEMMs of ``bench_kernels.py`` (fc1: 2048 -> 4096 and fc2: 2048 -> 2048,
16 experts, T = 8192 tokens, bf16) with CUDA events, for each candidate of the row-tile kernel (forward and
input gradient) and then of the weight-gradient kernel, and prints the best of each. Copy them into
``GEMM_TUNING``. The dense bf16 GEMM rate of the same GPU is printed first as the anchor.
"""

from __future__ import annotations

import argparse

import torch

from megatron_zaya.kernels import grouped_gemm
from megatron_zaya.kernels.utils import platform

from .bench_kernels import SMOKE, Shapes, cases, gemm_anchor, time_passes
from .timing import gpu_or_smoke, sweep_groups

ROW_TILES = [dict(block_m=m, block_n=n, block_k=k, warps=w, stages=st) for m, n, k, w, st in (
    (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3),
    (128, 128, 128, 8, 3), (64, 256, 64, 4, 4), (64, 128, 64, 4, 4))]  # fmt: skip
WEIGHT_GRAD = [dict(wgrad_block_m=m, wgrad_block_n=n, wgrad_block_r=r, wgrad_warps=w, wgrad_stages=st)
               for m, n, r, w, st in ((128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3),
                                      (256, 128, 64, 8, 3), (128, 128, 128, 8, 3), (128, 128, 32, 4, 4),
                                      (64, 128, 64, 4, 4))]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    device = gpu_or_smoke("tune_grouped_gemm.py", args.smoke)
    shapes = SMOKE if args.smoke else Shapes()
    key = platform(torch.device(device))
    if device == "cuda":
        gemm_anchor(device, shapes)
    chosen = [c for c in cases(shapes, device) if c.name in ("grouped_gemm_fc1", "grouped_gemm_fc2")]
    inputs = [case.make_inputs() for case in chosen]
    flops = sum(sum(case.flops) for case in chosen)

    def forward_backward_ms() -> float:
        ms = sum(time_passes(case.kernel, tensors, extra, device)[1] for case, (tensors, extra) in zip(chosen, inputs))
        print(f"  {flops / ms / 1e9:.0f} TFLOP/s", end=" ")
        return ms

    print(f"platform {key}; current {grouped_gemm.GEMM_TUNING[key]}")
    best = sweep_groups(grouped_gemm.GEMM_TUNING[key], {"row tiles": ROW_TILES, "weight gradient": WEIGHT_GRAD},
                        forward_backward_ms)
    print(f"best (forward + backward of fc1 and fc2): {best}")


if __name__ == "__main__":
    main()
