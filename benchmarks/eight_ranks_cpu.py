"""Issue #10's eight-rank layouts on CPU: the real ``zaya-pretrain`` CLI on 8 gloo processes, tiny size.

    python benchmarks/eight_ranks_cpu.py --out OUT [--layouts ep8,dp8_muon] [--iters 20]

* ``ep8``: expert parallel 8, the ``tiny`` preset with 16 experts (2 per rank); world 8, so the dense part
  is data parallel 8. Adam (Megatron's).
* ``dp8_muon``: data parallel 8 with ``--use-distributed-optimizer --optimizer zaya_muon`` (each matrix's
  Newton-Schulz on one rank, the results gathered).

Each runs against one process with the same flags and the same global batch (16 sequences of 64 tokens:
eight micro-batches of 2 accumulated on one process, one micro-batch of 2 on each of eight ranks). Each EP
rank initialises only its own experts, from its own generator, so a fresh EP run need not draw one
process's weights; hence both start from one checkpoint: one process trains
``BASE_ITERS`` iterations and saves, then the reference and the eight-rank run load it and train ``--iters``
more. EP8 loads the weights only, and so does its reference (as measured on 2026-11-29, before the experts' optimizer
state became reshardable across EP sizes); DP8 loads the Muon state too (resharded from one rank to eight).

The floor: float32 results depend on the order of summation, and training amplifies such differences (Muon
most: Newton-Schulz lifts a gradient's smallest singular directions to unit size). So the reference runs a
second time with one micro-batch of 16 instead of eight accumulated micro-batches of 2, the same samples
summed in another order; the eight-rank run should differ from the reference no more than that run does.

Losses: Megatron's ``lm loss`` log lines (averaged over data-parallel ranks, 7 significant digits). The
loss-curve CSV (``<save>/loss.csv``) holds only the writing rank's micro-batches, so it cannot compare a
data-parallel run. Megatron's second logged iteration after a start reports the mean of the first two,
identically in every run, so the lines still compare. Timings: the mean ``elapsed time per iteration``
after the first 5, and the optimizer's share (``--timing-log-level 1``'s ``optimizer`` timer, max over
ranks, against the iteration time). On two CPU cores shared by eight processes these times say nothing
about GPUs; they are indicative only.

Writes ``OUT/<run>.log``, ``OUT/eight-ranks.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+).*?"
                       r"lm loss: ([0-9.E+-]+)")
# Megatron's timer block after each logged iteration: "optimizer ....: (min, max)" in ms across ranks.
OPTIMIZER_TIMER = re.compile(r"^\s+optimizer \.+: \(([0-9.]+), ([0-9.]+)\)", re.MULTILINE)
WORLD, BASE_ITERS = 8, 2
COMMON = ["--zaya-preset", "tiny", "--mock-data", "--seq-length", "64", "--micro-batch-size", "2",
          "--global-batch-size", "16", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "2",
          "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", "1234",
          "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--save-interval", "1000",
          "--no-load-rng", "--timing-log-level", "1"]  # fmt: skip
# name -> (model and optimizer flags of both runs, eight-rank-only flags, load the optimizer state)
LAYOUTS = {
    "ep8": (["--num-experts", "16"], ["--expert-model-parallel-size", "8"], False),
    "dp8_muon": (["--optimizer", "zaya_muon"], ["--use-distributed-optimizer"], True),
}


def pretrain(name: str, flags: list[str], out: Path, nproc: int) -> None:
    """One ``zaya-pretrain`` run (under ``torch.distributed.run`` for several processes), logged to ``OUT/name.log``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1" if nproc > 1 else "2"}
    env.pop("WORLD_SIZE", None)
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    command = [sys.executable, *launcher, "-m", "megatron_zaya.pretrain", *flags]
    print(f"[{time.strftime('%H:%M:%S')}] {name}: python {' '.join(command[1:])}", flush=True)
    start = time.time()
    with (out / f"{name}.log").open("w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    print(f"[{time.strftime('%H:%M:%S')}] {name}: exit {code} after {time.time() - start:.0f} s", flush=True)
    if code != 0:
        sys.exit(f"{name} failed (exit {code}); see {out / f'{name}.log'}")


def parse(log: Path) -> tuple[dict[int, tuple[float, float]], list[float]]:
    """``({iteration: (ms, lm loss)}, [optimizer ms, max over ranks, per logged iteration])`` of a run's log."""
    text = log.read_text()
    rows = {int(i): (float(ms), float(loss)) for i, ms, loss in ITERATION.findall(text)}
    return rows, [float(high) for _, high in OPTIMIZER_TIMER.findall(text)]


def timing(rows: dict[int, tuple[float, float]], optimizer_ms: list[float], skip: int = 5) -> dict:
    iteration_ms = [ms for _, (ms, _) in sorted(rows.items())][skip:]
    optimizer = optimizer_ms[skip:len(rows)]
    mean_ms = statistics.mean(iteration_ms)
    return {"ms_per_iter": mean_ms, "optimizer_ms": statistics.mean(optimizer) if optimizer else None,
            "optimizer_share": statistics.mean(optimizer) / mean_ms if optimizer else None}


def compare(name: str, out: Path) -> dict:
    """``name``'s losses and timings against its layout's one-process reference."""
    ours, our_optimizer = parse(out / f"{name}.log")
    reference, reference_optimizer = parse(out / f"{name.removesuffix('_floor')}_reference.log")
    common = sorted(set(ours) & set(reference))
    differences = [abs(ours[i][1] - reference[i][1]) for i in common]
    relative = [d / abs(reference[i][1]) for d, i in zip(differences, common, strict=True)]
    return {"run": name, "iterations": common, "losses": [ours[i][1] for i in common],
            "reference_losses": [reference[i][1] for i in common], "max_abs_loss_diff": max(differences),
            "max_rel_loss_diff": max(relative), "eight_ranks": timing(ours, our_optimizer),
            "one_process": timing(reference, reference_optimizer)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.layouts.split(","):
        model, layout, load_optimizer = LAYOUTS[name]
        base = args.out / f"{name}_base"
        flags = COMMON + model + ["--train-iters", str(BASE_ITERS + args.iters)]  # one schedule for all four runs
        pretrain(f"{name}_base", flags + ["--exit-interval", str(BASE_ITERS), "--save", str(base)], args.out, 1)
        resume = flags + ["--load", str(base)]
        resume += [] if load_optimizer else ["--no-load-optim"]
        pretrain(f"{name}_reference", resume + ["--save", str(args.out / f"{name}_reference")], args.out, 1)
        pretrain(f"{name}_floor", resume + ["--micro-batch-size", "16", "--save", str(args.out / f"{name}_floor")],
                 args.out, 1)
        pretrain(name, resume + layout + ["--save", str(args.out / name)], args.out, WORLD)
        results.append({**compare(name, args.out), "floor": compare(f"{name}_floor", args.out)["max_abs_loss_diff"]})
        (args.out / "eight-ranks.json").write_text(json.dumps(results, indent=1))

    print("\n| layout | iterations | max abs Δ loss | max rel Δ loss | floor: abs Δ, 1 proc mb 16 | "
          "ms/iter 1 proc | ms/iter 8 ranks | optimizer share 1 proc | optimizer share 8 ranks |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        one, eight = r["one_process"], r["eight_ranks"]
        print(f"| {r['run']} | {r['iterations'][0]}-{r['iterations'][-1]} | {r['max_abs_loss_diff']:.1e} | "
              f"{r['max_rel_loss_diff']:.1e} | {r['floor']:.1e} | {one['ms_per_iter']:.0f} | "
              f"{eight['ms_per_iter']:.0f} | {one['optimizer_share']:.1%} | {eight['optimizer_share']:.1%} |")


if __name__ == "__main__":
    main()
