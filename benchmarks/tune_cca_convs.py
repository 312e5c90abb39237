"""Tune the CCA convolution kernels' launch (``cca.CONV_TUNING``) on this GPU.

    python -m benchmarks.tune_cca_convs            # CUDA or ROCm GPU, well under a minute
    python -m benchmarks.tune_cca_convs --smoke    # tiny shapes, any device: checks the script runs

For each group of launch settings (forward, the grouped and depthwise conv backward, the weight gradient) it
times forward + backward of the ``cca_convs`` case of ``bench_kernels.py`` (the q convolutions at T = 8192,
1024 channels) as CUDA-graph replays, with the cuDNN ``conv1d`` reference timed the same way as the baseline,
and prints the best of every group. Copy them into ``CONV_TUNING``.
"""

from __future__ import annotations

import argparse

import torch

from megatron_zaya.kernels import cca
from megatron_zaya.kernels.utils import platform

from .bench_kernels import SMOKE, Shapes, cases, time_passes, warm_up
from .timing import gpu_or_smoke, settings_grid, sweep_groups


#: Each group's settings are swept with the other groups at the table's values.
GROUPS = {
    "forward": settings_grid(rows=(32, 64, 128), warps=(4, 8)),
    "grouped conv backward": settings_grid(grouped_rows=(32, 64, 128), grouped_warps=(4, 8)),
    "depthwise backward": settings_grid(depthwise_rows=(16, 32, 64), depthwise_warps=(4, 8)),
    "weight gradient": settings_grid(weight_rows=(32, 64, 128), weight_warps=(4, 8), weight_stages=(2, 3)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    device = gpu_or_smoke("tune_cca_convs.py", args.smoke)
    graph = device == "cuda"
    key = platform(torch.device(device))
    case = next(c for c in cases(SMOKE if args.smoke else Shapes(), device) if c.name == "cca_convs")
    tensors, extra = case.make_inputs()
    forward, both, _ = time_passes(case.reference, tensors, extra, device, graph=graph)
    print(f"platform {key}; cuDNN conv1d reference: forward {forward:.3f} ms, forward + backward {both:.3f} ms")

    def forward_backward_ms() -> float:
        warm_up(case.kernel, tensors, extra)
        return time_passes(case.kernel, tensors, extra, device, graph=graph)[1]

    best = sweep_groups(cca.CONV_TUNING[key], GROUPS, forward_backward_ms)
    print(f"best (forward + backward of the q convolutions): {best}")


if __name__ == "__main__":
    main()
