"""Tune the sort by expert's launch table (``sort_by_expert.SORT_TUNING``) on this GPU, on the map the MoE layer
sorts: top-1 ``[T, E]`` bool with its gates ``[T, E]`` fp32 (T = 4096 x ``--batch``, E = 16 experts, a share of
tokens routed to none); a map whose rows are not 16-byte aligned (``[T, E + 1]``) is timed beside it, with the
table's setting first (a sweep cut short still answers it) and with the best setting last.

    python -m benchmarks.tune_sort            # CUDA or ROCm GPU, a few minutes: each setting compiles
    python -m benchmarks.tune_sort --smoke    # tiny shapes, the kernel interpreted on CPU: checks the script

Each setting is timed as CUDA-graph replays (the median), after the torch reference (``ops.experts``) as the
baseline; the best setting of the model's map is printed, to copy into the table.
"""

from __future__ import annotations

import argparse
import os

import torch

from .timing import gpu_or_smoke, settings_grid, sweep_groups

EXPERTS = 16
CANDIDATES = settings_grid(block=(128, 256, 512, 1024), count_block=(512, 1024, 2048, 4096), warps=(4, 8, 16))
SMOKE_CANDIDATES = settings_grid(block=(8, 16), count_block=(32,), warps=(4,))


def routing(tokens: int, columns: int, device: str, none_share: float = 0.1):
    """A top-1 routing map ``[tokens, columns]`` over the first ``EXPERTS`` columns and its gates."""
    generator = torch.Generator(device=device).manual_seed(0)
    expert = torch.randint(0, EXPERTS, (tokens,), device=device, generator=generator)
    routed = torch.rand(tokens, device=device, generator=generator) >= none_share
    routing_map = torch.zeros(tokens, columns, dtype=torch.bool, device=device)
    routing_map[torch.arange(tokens, device=device)[routed], expert[routed]] = True
    gates = torch.rand(tokens, columns, device=device, generator=generator) * routing_map
    return routing_map, gates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2, help="T = 4096 x batch tokens")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    device = gpu_or_smoke("tune_sort.py", args.smoke)
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel module is imported, just below
    from megatron_zaya.kernels import sort_by_expert
    from megatron_zaya.kernels.utils import platform
    from megatron_zaya.ops import experts

    from .bench_kernels import median_ms

    tokens = 40 if args.smoke else 4096 * args.batch
    maps = {"[T, E]": routing(tokens, EXPERTS, device), "[T, E + 1]": routing(tokens, EXPERTS + 1, device)}
    for name, (routing_map, gates) in maps.items():
        expected = experts.sort_by_expert(routing_map, 0, EXPERTS)
        got = sort_by_expert.sort_by_expert(routing_map, 0, EXPERTS, gates)
        if not all(torch.equal(a, b) for a, b in zip(got, expected)):
            raise SystemExit(f"the kernel's sort of the {name} map differs from the reference")
        reference_ms = median_ms(lambda: experts.sort_by_expert(routing_map, 0, EXPERTS), device, graph=True)
        print(f"{name} map, T = {tokens}: the torch reference {reference_ms:.4f} ms")

    table = sort_by_expert.SORT_TUNING[platform(torch.device(device))]
    print(f"platform {platform(torch.device(device))}; current {table}")

    def measure(name: str):
        routing_map, gates = maps[name]
        return lambda: median_ms(lambda: sort_by_expert.sort_by_expert(routing_map, 0, EXPERTS, gates), device, True)

    candidates = SMOKE_CANDIDATES if args.smoke else CANDIDATES
    current = {key: table[key] for key in candidates[0]}
    sweep_groups(table, {"[T, E + 1], the table's setting": [current]}, measure("[T, E + 1]"))  # before the sweep
    best = sweep_groups(table, {"[T, E]": candidates}, measure("[T, E]"))
    sweep_groups(table, {"[T, E + 1]": [best]}, measure("[T, E + 1]"))
    print(f"best on the model's [T, E] map: {best}")


if __name__ == "__main__":
    main()
