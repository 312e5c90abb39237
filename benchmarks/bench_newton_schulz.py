"""Benchmark Muon's Newton–Schulz on the matrices of one ZAYA1-8B layer: torch vs our Triton kernels.

    python -m benchmarks.bench_newton_schulz            # needs a CUDA or ROCm GPU (about 3 minutes on an H200)
    python -m benchmarks.bench_newton_schulz --smoke    # tiny shapes, any device: checks the script runs

Matrices (the reference set: q, k, o and the experts): q 1024×2048, k 256×2048, o 2048×1024, 16 expert
fc1 4096×2048 and 16 expert fc2 2048×2048, plus ZAYA1's two value halves (128×2048 each) and the four
router matrices. 5 quintic steps in bf16. For each shape it prints the median time of

* ``torch loop``: one plain-torch Newton–Schulz per matrix (what Megatron's Muon does per expert),
* ``torch batched``: our torch reference on the stacked matrices,
* ``triton``: our symmetric kernels (X·Xᵀ and b·A + c·A·A on one triangle) on the stacked matrices,
* ``gram``: the Gram form (iterating on the m×m X·Xᵀ in fp16, one restart) with the same kernels, on every
  shape, also where it is not chosen (the torch Gram reference where Triton is off),
* ``ours``: what ZayaMuon runs: ``newton_schulz`` with backend and iteration ``auto`` (named in the ``path``
  column) and ``graphed=True`` (batches of at most 2^23 elements replay a CUDA graph of the same kernels),
* ``megatron``: Megatron's own Muon orthogonalisation, ``emerging_optimizers``' ``newton_schulz`` (fp32 in,
  bf16 matmuls: Megatron's default ``fp32_matmul_prec="medium"``), one call per matrix as Megatron's Muon
  makes them; present when ``emerging-optimizers`` (and ``absl-py``) is importable, e.g.
  ``pip install --target /tmp/eo emerging-optimizers absl-py`` and ``PYTHONPATH=/tmp/eo`` for this script only,

the ratios over ``ours``, the FLOP ratio of the loop over ``ours`` (general GEMMs, 4m²n + 2m³ per step, against
what ``ours`` computes: the bound its kernels would reach at cuBLAS's FLOP rate), the TFLOP/s of ``ours``
counting the loop's FLOPs, and the relative error of each path against float64. Then the layer totals
(the target for loop/ours on the reference set is 1.6×), and the Newton–Schulz time per rank
of a whole 40-layer ZAYA1-8B step when ZayaMuon spreads the matrices over DP ranks (FLOP-balanced owners;
Megatron's non-layer-wise Muon runs all of them on every rank). Reference point (H200, torch
2.11, the reference set): plain torch 26.0 ms per layer; emerging_optimizers 22.1 ms; its Triton SYRK path 41.6 ms.

Last, ``--step-layers`` layers (default 8) as whole optimizer steps on fp32 parameters with gradients: a real
``ZayaMuon.step()`` (equal shapes batched across layers) against a per-matrix torch Muon step written here
(momentum, the torch loop's or Megatron's orthogonalisation, update), per layer; then the momentum and
Newton–Schulz of the busiest rank under ZayaMuon's owners at DP = 1, 2, 4, 8, measured on this one GPU.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from megatron_zaya.ops.newton_schulz import (
    QUINTIC_COEFFICIENTS,
    gram_newton_schulz_flops,
    gram_newton_schulz_reference,
    gram_newton_schulz_triton,
    gram_segments,
    newton_schulz,
    newton_schulz_flops,
    newton_schulz_path,
    newton_schulz_reference,
    newton_schulz_triton,
    triton_usable,
)
from megatron_zaya.optim.muon import MuonConfig, ZayaMuon
from megatron_zaya.optim.plan import WorkItem, assign_owners
from megatron_zaya.optim.roles import MatrixLayout

from .timing import call_times, gpu_or_smoke

COEFFICIENTS = (QUINTIC_COEFFICIENTS,) * 5
LAYER = [  # (name, count, rows, cols) of one ZAYA1-8B layer
    ("q", 1, 1024, 2048),
    ("k", 1, 256, 2048),
    ("v halves", 2, 128, 2048),
    ("o", 1, 2048, 1024),
    ("router down", 1, 256, 2048),
    ("router fc1/fc2", 2, 256, 256),
    ("router out", 1, 17, 256),
    ("experts fc1", 16, 4096, 2048),
    ("experts fc2", 16, 2048, 2048),
]
REFERENCE_SET = {"q", "k", "o", "experts fc1", "experts fc2"}  # the first Newton–Schulz timings' matrices
SMOKE_LAYER = [("q", 1, 64, 96), ("k", 1, 16, 96), ("experts fc1", 4, 96, 48), ("experts fc2", 4, 48, 48)]


def _megatron_newton_schulz():
    """Megatron's Muon orthogonalisation (emerging_optimizers), or None where it is not installed."""
    try:
        from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz
    except ImportError:
        return None

    def orthogonalise(g: torch.Tensor) -> torch.Tensor:
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("medium")  # Megatron's default fp32_matmul_prec
        try:
            # "simple" is our (3.4445, -4.7750, 2.0315) at every step, so the errors compare; Megatron's default
            # "quintic" varies them per step at the same cost
            return newton_schulz(g.float(), steps=len(COEFFICIENTS), coefficient_type="simple")
        finally:
            torch.set_float32_matmul_precision(previous)

    return orthogonalise


megatron_newton_schulz = _megatron_newton_schulz()


def timed(fn, repeats: int) -> float:
    """Median milliseconds of ``fn()`` (after two warm-up calls)."""
    return statistics.median(call_times(fn, warmup=2, iters=repeats))


def relative_error(result: torch.Tensor, oracle: torch.Tensor) -> float:
    return ((result.double() - oracle).norm() / oracle.norm()).item()


def flops(count: int, rows: int, cols: int, triton: bool = False, gram: bool = False) -> float:
    """FLOPs of ``count`` matrices: general GEMMs (the loop) by default, else the path ``(triton, gram)``."""
    if gram:
        return count * gram_newton_schulz_flops(rows, cols, gram_segments(COEFFICIENTS), symmetric=triton)
    return count * newton_schulz_flops(rows, cols, len(COEFFICIENTS), symmetric=triton)


def bench_shape(name, count, rows, cols, device, repeats, use_triton, tiles=()) -> dict:
    G = torch.randn(count, rows, cols, device=device)
    oracle = newton_schulz_reference(G[:1].double(), COEFFICIENTS, dtype=torch.float64)
    triton, gram = newton_schulz_path(G, COEFFICIENTS)
    row = {"name": name, "count": count, "shape": f"{rows}x{cols}", "flops": flops(count, rows, cols),
           "path": ("triton" if triton else "torch") + ("+gram" if gram else ""),
           "flops_ours": flops(count, rows, cols, triton, gram)}  # fmt: skip
    row["loop"] = timed(lambda: [newton_schulz_reference(g, COEFFICIENTS, dtype=torch.bfloat16) for g in G],
                        repeats)  # fmt: skip
    row["batched"] = timed(lambda: newton_schulz_reference(G, COEFFICIENTS, dtype=torch.bfloat16), repeats)
    row["err_torch"] = relative_error(newton_schulz_reference(G[:1], COEFFICIENTS, dtype=torch.bfloat16), oracle)
    gram_path = gram_newton_schulz_triton if use_triton else gram_newton_schulz_reference
    row["gram"] = timed(lambda: gram_path(G, COEFFICIENTS, dtype=torch.bfloat16), repeats)
    row["err_gram"] = relative_error(gram_path(G[:1], COEFFICIENTS, dtype=torch.bfloat16), oracle)
    row["ours"] = timed(lambda: newton_schulz(G, COEFFICIENTS, graphed=True), repeats)
    row["err_ours"] = relative_error(newton_schulz(G[:1], COEFFICIENTS, graphed=True), oracle)
    if megatron_newton_schulz is not None:
        row["megatron"] = timed(lambda: [megatron_newton_schulz(g) for g in G], repeats)
        row["err_megatron"] = relative_error(megatron_newton_schulz(G[0])[None], oracle)
    if use_triton:
        row["triton"] = timed(lambda: newton_schulz_triton(G, COEFFICIENTS, dtype=torch.bfloat16), repeats)
        row["err_triton"] = relative_error(newton_schulz_triton(G[:1], COEFFICIENTS, dtype=torch.bfloat16), oracle)
        row["tiles"] = {  # explicit BLOCK_M x BLOCK_K choices, to tune kernels.newton_schulz._tile_sizes
            (bm, bk): timed(lambda: newton_schulz_triton(G, COEFFICIENTS, dtype=torch.bfloat16, block_m=bm,
                                                         block_k=bk), repeats)
            for bm, bk in tiles
        }  # fmt: skip
    return row


def per_rank_model_time(rows: list[dict], layers: int, dp: int, best: str) -> float:
    """Newton–Schulz ms on the busiest rank for a ``layers``-layer model, ZayaMuon's owners at size ``dp``."""
    items, ms_per_matrix = [], []
    for layer in range(layers):
        for row in rows:
            r, c = map(int, row["shape"].split("x"))
            for _ in range(row["count"]):
                items.append(WorkItem(layer, len(items), 0, MatrixLayout(), (r, c), (r, c), None))
                ms_per_matrix.append(row[best] / row["count"])
    owned = assign_owners(items, dp, len(COEFFICIENTS))
    load = [0.0] * dp
    for item, ms in zip(owned, ms_per_matrix):
        load[item.owner] += ms
    return max(load)


def step_parameters(layer_spec, layers: int, device: str):
    """fp32 parameters (with gradients) of ``layers`` layers as the model holds them: one 2-D parameter per
    matrix, but the value halves in one parameter of two row blocks. Returns (params, layouts, block counts)."""
    params, layouts, blocks = [], {}, []
    for _ in range(layers):
        for name, count, rows, cols in layer_spec:
            pieces = [(count, rows * count)] if name == "v halves" else [(1, rows)] * count
            for row_blocks, total_rows in pieces:
                param = torch.nn.Parameter(torch.randn(total_rows, cols, device=device) * 0.02)
                param.grad = torch.randn_like(param)
                params.append(param)
                blocks.append(row_blocks)
                if row_blocks > 1:
                    layouts[param] = MatrixLayout(row_blocks=row_blocks)
    return params, layouts, blocks


def reference_muon_step(params, blocks, momenta, orthogonalise, mu: float = 0.95, lr: float = 1e-6) -> None:
    """A per-matrix Muon step in plain torch: Nesterov momentum, ``orthogonalise`` each matrix, update."""
    for param, row_blocks, momentum in zip(params, blocks, momenta):
        momentum.mul_(mu).add_(param.grad)
        update = param.grad + mu * momentum
        for rows, block in zip(param.data.chunk(row_blocks), update.chunk(row_blocks)):
            rows.add_(orthogonalise(block).to(rows.dtype), alpha=-lr * 0.2 * max(block.shape) ** 0.5)


def bench_step(layer_spec, layers: int, repeats: int, device: str, profile: bool = False) -> None:
    """Whole Muon steps over ``layers`` layers: ZayaMuon (equal shapes batched across layers) vs per-matrix loops;
    then the Newton–Schulz (+ momentum) work of the busiest data-parallel rank under ZayaMuon's owners."""
    params, layouts, blocks = step_parameters(layer_spec, layers, device)
    muon = ZayaMuon(params, lr=1e-6, layouts=layouts, config=MuonConfig(coefficients=COEFFICIENTS))
    muon.step()  # creates the momentum
    times = {"zaya_muon": timed(muon.step, repeats)}
    momenta = [torch.zeros_like(p) for p in params]
    times["torch loop"] = timed(lambda: reference_muon_step(
        params, blocks, momenta, lambda g: newton_schulz_reference(g, COEFFICIENTS, dtype=torch.bfloat16)), repeats)
    if megatron_newton_schulz is not None:
        times["megatron loop"] = timed(lambda: reference_muon_step(params, blocks, momenta, megatron_newton_schulz),
                                       repeats)
    if profile and device == "cuda":
        from torch.profiler import ProfilerActivity, profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            muon.step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=60))
    per_layer = ", ".join(f"{k} {v / layers:.2f} ms" for k, v in times.items())
    ratios = ", ".join(f"{k}/zaya_muon {v / times['zaya_muon']:.2f}x" for k, v in times.items() if k != "zaya_muon")
    print(f"whole Muon step over {layers} layers ({len(muon.items)} items), per layer: {per_layer}; {ratios}")
    all_items = muon.items
    for dp in (1, 2, 4, 8):
        owners = assign_owners(all_items, dp, len(COEFFICIENTS))
        load = [0.0] * dp
        for item in owners:
            load[item.owner] += item.flops(len(COEFFICIENTS))
        busiest = max(range(dp), key=lambda r: load[r])
        # What ZayaMuon's rank ``busiest`` runs at this DP size (one GPU plays that rank; no exchange).
        muon.owned = [item for item in owners if item.owner == busiest]
        ms = timed(lambda: [None for _ in muon._orthogonalised_owned()], repeats)
        if dp == 1:
            single = ms
        print(f"  DP={dp}: busiest rank's momentum + Newton–Schulz {ms:8.2f} ms ({single / ms:.2f}x less than DP=1;"
              f" {max(load) / 1e9:.1f} GFLOP)")
    muon.owned = [item for item in all_items if item.owner == 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--layers", type=int, default=40, help="layers of the model for the per-rank estimate")
    parser.add_argument("--step-layers", type=int, default=8,
                        help="layers of the whole-step measurement (0: skip it; ~2.5 GB of GPU memory per layer)")
    parser.add_argument("--profile-step", action="store_true", help="print the kernels of one ZayaMuon step")
    parser.add_argument("--tiles", default="", help="also time these Triton tiles, e.g. 64x64,128x64,128x32 "
                                                     "(BLOCK_M x BLOCK_K; the default is the built-in heuristic)")
    args = parser.parse_args()
    tiles = [tuple(int(x) for x in t.split("x")) for t in args.tiles.split(",") if t]

    device = gpu_or_smoke("bench_newton_schulz.py", args.smoke)
    torch.manual_seed(0)
    use_triton = triton_usable(torch.empty(0, device=device))
    layer = SMOKE_LAYER if args.smoke else LAYER
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; torch {torch.__version__}; "
          f"5 quintic steps, bf16; Triton {'on' if use_triton else 'off (torch only)'}")  # fmt: skip
    header = f"{'matrices':16s} {'n':>3s} {'shape':>10s} {'torch loop':>11s} {'batched':>9s}"
    header += f" {'megatron':>9s}" if megatron_newton_schulz else ""
    header += f" {'triton':>8s}" if use_triton else ""
    header += f" {'gram':>8s} {'ours':>8s} {'path':>12s} {'loop/ours':>10s} {'batch/ours':>11s} {'FLOPs l/o':>10s}"
    header += f" {'TFLOP/s':>8s} {'err torch':>10s}" + (f" {'err triton':>11s}" if use_triton else "")
    print(header + f" {'err gram':>9s} {'err ours':>9s}")
    rows = []
    for name, count, r, c in layer:
        row = bench_shape(name, count, r, c, device, args.repeats, use_triton, tiles)
        rows.append(row)
        line = f"{name:16s} {count:3d} {row['shape']:>10s} {row['loop']:9.2f}ms {row['batched']:7.2f}ms"
        line += f" {row['megatron']:7.2f}ms" if megatron_newton_schulz else ""
        line += f" {row['triton']:6.2f}ms" if use_triton else ""
        line += (f" {row['gram']:6.2f}ms {row['ours']:6.2f}ms {row['path']:>12s} {row['loop'] / row['ours']:9.2f}x"
                 f" {row['batched'] / row['ours']:10.2f}x {row['flops'] / row['flops_ours']:9.2f}x"
                 f" {row['flops'] / row['ours'] / 1e9:8.1f} {row['err_torch']:10.2e}")  # fmt: skip
        line += f" {row['err_triton']:11.2e}" if use_triton else ""
        line += f" {row['err_gram']:9.2e} {row['err_ours']:9.2e}"
        line += f" err megatron {row['err_megatron']:.2e}" if megatron_newton_schulz else ""
        if row.get("tiles"):
            line += "  tiles: " + ", ".join(f"{bm}x{bk} {ms:.2f}ms" for (bm, bk), ms in row["tiles"].items())
        print(line)

    paths = ["loop", "batched"] + (["megatron"] if megatron_newton_schulz else []) + (["triton"] if use_triton else [])
    paths += ["gram", "ours"]
    for label, subset in (("reference set", [r for r in rows if r["name"] in REFERENCE_SET]), ("whole layer", rows)):
        totals = {p: sum(r[p] for r in subset) for p in paths}
        text = ", ".join(f"{p} {t:.2f} ms" for p, t in totals.items())
        text += "; " + ", ".join(f"{p}/ours {totals[p] / totals['ours']:.2f}x" for p in paths if p != "ours")
        text += f"; FLOPs loop/ours {sum(r['flops'] for r in subset) / sum(r['flops_ours'] for r in subset):.2f}x"
        print(f"per layer ({label}): {text}")

    best = min(paths, key=lambda p: sum(r[p] for r in rows))
    redundant = args.layers * sum(r["loop"] for r in rows)
    print(f"whole {args.layers}-layer model, Newton–Schulz per optimizer step on the busiest rank "
          f"(ZayaMuon, {best} path; every rank redundantly with a per-matrix torch loop: {redundant:.0f} ms):")
    for dp in (1, 2, 4, 8, 16, 64):
        ms = per_rank_model_time(rows, args.layers, dp, best)
        print(f"  DP={dp:3d}: {ms:9.1f} ms   ({redundant / ms:6.1f}x less than the redundant loop)")
    if args.step_layers:
        bench_step(layer, 2 if args.smoke else args.step_layers, args.repeats, device, args.profile_step)


if __name__ == "__main__":
    main()
