"""Tune the grouped expert GEMM's launch settings (``grouped_gemm.GEMM_TUNING``) on this GPU.

    python -m benchmarks.tune_grouped_gemm            # CUDA or ROCm GPU, one to two minutes
    python -m benchmarks.tune_grouped_gemm --main-grad bf16   # the weight gradient alone, as training runs it
    python -m benchmarks.tune_grouped_gemm --smoke    # tiny shapes, any device: checks the script runs

Times forward + backward of both expert GEMMs of ``bench_kernels.py`` (fc1: 2048 -> 4096 and fc2: 2048 -> 2048,
16 experts, T = ``--batch`` x 4096 tokens, bf16) with CUDA events, for each candidate of the row-tile kernel
(forward and input gradient) and then of the weight-gradient kernel, and prints the best of each. Copy them into
``GEMM_TUNING``. The dense bf16 GEMM rate of the same GPU is printed first as the anchor.

``--main-grad fp32|bf16`` times the weight-gradient kernel alone as Megatron's DDP has it run: each expert's
gradient added into its ``main_grad``, views of one flat buffer of that dtype (fp32 by default, bf16 with
``--grad-reduce-in-bf16``). That read-modify-write of the gradients, at ~512 tokens of contraction per expert,
makes the kernel memory-bound where the fresh write is not, so its best tile can differ.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from megatron_zaya.kernels import grouped_gemm
from megatron_zaya.kernels.utils import platform

from .bench_kernels import SMOKE, Shapes, cases, gemm_anchor, median_ms, time_passes
from .grouped_gemm_backends import Operands, gemm_function
from .timing import gpu_or_smoke, sweep_groups

ROW_TILES = [dict(block_m=m, block_n=n, block_k=k, warps=w, stages=st) for m, n, k, w, st in (
    (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3),
    (128, 128, 128, 8, 3), (64, 256, 64, 4, 4), (64, 128, 64, 4, 4))]  # fmt: skip
WEIGHT_GRAD = [dict(wgrad_block_m=m, wgrad_block_n=n, wgrad_block_r=r, wgrad_warps=w, wgrad_stages=st)
               for m, n, r, w, st in ((128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3),
                                      (256, 128, 64, 8, 3), (128, 128, 128, 8, 3), (128, 128, 32, 4, 4),
                                      (64, 128, 64, 4, 4), (128, 256, 32, 8, 4), (256, 128, 32, 8, 4),
                                      (128, 128, 64, 8, 4), (64, 256, 64, 4, 3), (256, 256, 32, 8, 3))]  # fmt: skip


def weight_grad_into_main_grad(shapes, device: str, dtype: torch.dtype):
    """Milliseconds of the weight-gradient kernel of fc1 and fc2, each expert's gradient added into its ``main_grad``
    (``dtype``, in DDP's layout: ``grouped_gemm_backends.Operands``); a callable for ``sweep_groups``."""
    t, d, f, e = shapes.tokens, shapes.hidden, shapes.ffn, shapes.experts
    calls = [gemm_function(Operands((e, m_dim, k_dim), t, device, torch.bfloat16, dtype), "weight_grad", "triton")
             for m_dim, k_dim in ((2 * f, d), (d, f))]
    flops = 2 * t * d * 3 * f

    def ms() -> float:
        total = sum(median_ms(call, device) for call in calls)
        print(f"  {flops / total / 1e9:.0f} TFLOP/s", end=" ")
        return total

    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--batch", type=int, default=2,
                        help="sequences of the benchmark's length (4096; 32 with --smoke): 4 is 16,384 tokens, as "
                             "ZAYA1-8B trains at micro-batch 4")
    parser.add_argument("--main-grad", choices=("fp32", "bf16"),
                        help="tune the weight-gradient kernel alone, adding into main_grad of this dtype")
    args = parser.parse_args()
    if args.batch < 1:
        parser.error(f"--batch must be at least 1, got {args.batch}")
    device = gpu_or_smoke("tune_grouped_gemm.py", args.smoke)
    shapes = dataclasses.replace(SMOKE if args.smoke else Shapes(), batch=args.batch)
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

    print(f"platform {key}; {shapes.tokens} tokens; current {grouped_gemm.GEMM_TUNING[key]}")
    if args.main_grad:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.main_grad]
        measure = weight_grad_into_main_grad(shapes, device, dtype)
        best = sweep_groups(grouped_gemm.GEMM_TUNING[key], {"weight gradient": WEIGHT_GRAD}, measure)
        print(f"best (weight gradients of fc1 and fc2 into a {args.main_grad} main_grad): {best}")
        return
    best = sweep_groups(grouped_gemm.GEMM_TUNING[key], {"row tiles": ROW_TILES, "weight gradient": WEIGHT_GRAD},
                        forward_backward_ms)
    print(f"best (forward + backward of fc1 and fc2): {best}")


if __name__ == "__main__":
    main()
