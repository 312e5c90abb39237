"""ZAYA1 across two GPUs with the real ``zaya-pretrain`` CLI: each layout against one GPU, in one invocation.

    python -m benchmarks.parallel_2gpu --out OUT [--parts scaling,context,references,match,resume,optimizer]

* ``scaling``: one GPU, DP2, EP2 (expert-parallel, 8 experts per GPU), TP2 (+SP), DP2 with overlapped gradient
  reduction, DP2 and EP2 with that and the distributed optimizer, and EP2 so with the all-gather dispatch
  (``--scaling-layouts`` picks them; ``LAYOUTS`` holds their flags) on the ZAYA1-8B-width model at 8 layers,
  sequence 4096, global batch 8 x 4096 tokens (the same samples in every layout). Reports
  tokens/s/GPU over the iterations after the 10th and scaling efficiency = tokens/s/GPU / one GPU's.
  ``--extra-flags=--zaya-cuda-graphs`` runs the scaling and context parts with the layers as CUDA-graph
  replays (not with EP2, TP2, PP2 or CP2, which the graphs refuse).
* ``context``: the same for CP2 at sequence 32768 (4 layers, global batch 2), plain and with the distributed
  optimizer and overlap (the CP ranks hold replicated weights: their gradients are reduced and their optimizer
  step repeated, as in DP2).
* ``references`` then ``match``: loss agreement over 20 steps. Fresh TP and PP runs draw other initial weights
  than one GPU (Megatron seeds model-parallel ranks apart), so every run starts from one checkpoint: one GPU
  trains 2 iterations and saves (4 layers; sequence 4096, and 32768 for CP), then one GPU (the reference) and
  DP2, EP2, TP2+SP, PP2 and CP2 each load it (resharding it) and train 20 more; per-iteration losses come from
  the loss-curve CSVs. ``references`` runs on ``--reference-gpu`` only, so it can share the machine.
* ``optimizer``: the optimizer step's share of a training step, and its 1/DP scaling: one GPU and DP2 with
  ``--optimizer zaya_muon`` (``--share-optimizers`` lists others, e.g. ``adam``), the distributed optimizer
  and overlapped reduction, the scaling part's model, micro-batch ``--share-mbs`` and each global batch of
  ``--share-gbs``; Megatron's ``optimizer`` timer (slowest rank) over ``elapsed time per iteration`` after
  ``--share-warmup`` iterations, its sub-timers (``--timing-log-level 2``), and one iteration under
  ``benchmarks.probe``: the optimizer phase's wall and device-busy time and its largest ops.
* ``resume``: DP2 with ``--use-distributed-optimizer --deterministic-mode``: 10 iterations saving at 5, then a
  second launch that loads iteration 5 and trains 6-10; the resumed losses must equal the uninterrupted ones.

One-GPU references run alone on GPU 0 (or two at once, one per GPU, when both are references). Writes
``OUT/<run>.log``, ``OUT/parallel-<parts>.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from .megatron_log import iterations, optimizer_ms

OPTIMIZER_SUBTIMER = re.compile(r"^\s+(optimizer-[a-z-]+) \.+: \([0-9.]+, ([0-9.]+)\)", re.M)
MODEL = ["--zaya-preset", "zaya1-8b-shallow", "--vocab-size", "262271"]
COMMON = ["--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "5", "--lr-decay-style", "cosine",
          "--weight-decay", "0.1", "--clip-grad", "1.0", "--bf16", "--log-interval", "1", "--eval-iters", "0",
          "--eval-interval", "1000", "--mock-data", "--tokenizer-type", "NullTokenizer", "--seed", "1234"]
SHORT = ["--seq-length", "4096", "--max-position-embeddings", "4096", "--micro-batch-size", "2",
         "--global-batch-size", "8"]
LONG = ["--num-layers", "4", "--seq-length", "32768", "--max-position-embeddings", "32768", "--micro-batch-size",
        "1", "--global-batch-size", "2"]
MATCH = ["--num-layers", "4", "--lr", "1e-4", "--no-load-rng",  # no dropout: nothing random to resume
         "--save-interval", "1000"]
# name -> (flags, the reference's shape)
MATCH_LAYOUTS = {"dp2": ([], "4k"), "ep2": (["--expert-model-parallel-size", "2"], "4k"),
                 "tp2": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], "4k"),
                 "pp2": (["--pipeline-model-parallel-size", "2"], "4k"),
                 "cp2_32k": (["--context-parallel-size", "2"], "32k")}
LAYOUTS = {"dp2": [], "ep2": ["--expert-model-parallel-size", "2"],
           "tp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
           # the gradient all-reduce runs bucket by bucket during the last micro-batch's backward
           "dp2_overlap": ["--overlap-grad-reduce"],
           # ZeRO-1 also halves each rank's optimizer step
           "dp2_distopt": ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
           # the same for the replicated non-expert weights of EP2
           "ep2_distopt": ["--expert-model-parallel-size", "2", "--use-distributed-optimizer", "--overlap-grad-reduce",
                           "--overlap-param-gather"],
           # EP2 through ZAYA's sync-free all-gather dispatch instead of Megatron's all-to-all (model/moe.py)
           "ep2_allgather": ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "allgather"],
           "ep2_allgather_distopt": ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "allgather",
                                     "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]}


def launch(name: str, flags: list[str], out: Path, gpus: str, nproc: int = 1, profile: str | None = None):
    """Start ``zaya-pretrain`` on ``gpus``; with ``profile`` (FIRST:COUNT) under ``benchmarks.probe``; logs in OUT."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus, "PYTHONUNBUFFERED": "1"}
    entry = ["-m", "megatron_zaya.pretrain"]
    if profile:
        env.update(ZAYA_BENCH_OUT=str(out / name), ZAYA_BENCH_PROFILE=profile)
        entry = ["-m", "benchmarks.probe", *entry]
    if nproc == 1:
        command = [sys.executable, *entry, *flags]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   *entry, *flags]
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {' '.join(command[1:])}", flush=True)
    return subprocess.Popen(command, stdout=(out / f"{name}.log").open("w"), stderr=subprocess.STDOUT, env=env)


def run_all(jobs: list[tuple], out: Path) -> None:
    """Run the jobs (name, flags, gpus, nproc[, profile]) together, each on its own GPUs, and wait for all."""
    procs = [(job[0], launch(*job[:2], out, *job[2:])) for job in jobs]
    for name, proc in procs:
        code = proc.wait()
        print(f"[{time.strftime('%H:%M:%S')}] {name}: exit {code}", flush=True)


def parse(out: Path, name: str) -> dict[int, tuple[float, float]]:
    """``{iteration: (ms, loss)}`` of a run's log."""
    return iterations((out / f"{name}.log").read_text())


def loss_csv(path: Path) -> dict[int, float]:
    if not path.is_file():
        return {}
    return {int(i): float(v) for i, v in (row.split(",") for row in path.read_text().splitlines()[1:])}


def summary(out: Path, name: str, reference: str | None, tokens_per_iter: int, gpus: int, first: int = 20):
    rows, row = parse(out, name), {"run": name, "gpus": gpus}
    steady = [ms for i, (ms, _) in rows.items() if i > 10]
    row["iterations"] = len(rows)
    if steady:
        row["ms_per_iter"] = statistics.mean(steady)
        row["ms_per_iter_median"] = statistics.median(steady)  # a few slow iterations (host jitter) move the mean
        row["tokens_per_s_per_gpu"] = tokens_per_iter / (row["ms_per_iter"] / 1000) / gpus
    if reference is not None:
        ref = parse(out, reference)
        common = [i for i in sorted(rows) if i in ref and i <= first]
        if common:
            row["max_abs_loss_diff"] = max(abs(rows[i][1] - ref[i][1]) for i in common)
            row["compared_iterations"] = len(common)
    return row


def optimizer_share(out: Path, name: str, gpus: int, first: int, last: int) -> dict:
    """Mean optimizer-step ms (slowest rank) and its share of the iteration, iterations first+1..last; the
    optimizer's sub-timers (``--timing-log-level 2``) and the probe's profile of the optimizer phase (rank 0).

    Megatron logs each iteration's timers right after its iteration line, so the k-th block is iteration k's."""
    rows = parse(out, name)  # in log order
    text = (out / f"{name}.log").read_text()
    steps = optimizer_ms(text)
    timed = [(rows[i][0], step) for i, step in zip(rows, steps) if first < i <= last]
    row = {"run": name, "share_gpus": gpus, "iterations": len(timed)}
    if timed:
        row["ms_per_iter"] = statistics.mean(t for t, _ in timed)
        row["optimizer_ms"] = statistics.mean(s for _, s in timed)
        row["optimizer_share"] = row["optimizer_ms"] / row["ms_per_iter"]
        sub = defaultdict(list)
        for timer, high in OPTIMIZER_SUBTIMER.findall(text):
            sub[timer].append(float(high))
        row["optimizer_subtimers_ms"] = {k: statistics.median(v) for k, v in sub.items()}
    profile = out / name / "profile.json"
    if profile.is_file():
        data = json.loads(profile.read_text())
        row["profile"] = {k: data.get(k) for k in ("optimizer_phase_wall_ms_per_step",
                                                    "optimizer_phase_busy_ms_per_step",
                                                    "optimizer_top_ops_ms_per_step")}
        row["profile"]["optimizer_device_ms"] = data["ms_per_step"].get("optimizer")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="scaling,context,resume")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--reference-gpu", default="0")
    parser.add_argument("--layouts", default=",".join(MATCH_LAYOUTS), help="the match part's layouts")
    parser.add_argument("--scaling-layouts", default="dp2,ep2,tp2", help="the scaling part's layouts")
    parser.add_argument("--extra-flags", default="",
                        help="flags added to the scaling and context runs, e.g. --extra-flags=--zaya-cuda-graphs")
    parser.add_argument("--share-optimizers", default="zaya_muon", help="the optimizer part's optimizers")
    parser.add_argument("--share-gbs", default="8", help="the optimizer part's global batch sizes, e.g. 8,128")
    parser.add_argument("--share-mbs", default="2", help="the optimizer part's micro-batch size")
    parser.add_argument("--share-iters", type=int, default=14, help="iterations of each optimizer-part run")
    parser.add_argument("--share-warmup", type=int, default=8, help="iterations left out of its timings")
    args = parser.parse_args()
    try:
        extra = shlex.split(args.extra_flags)
    except ValueError as error:  # e.g. an unclosed quote
        parser.error(f"--extra-flags {args.extra_flags!r}: {error}")
    args.out.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(","))
    short = MODEL + COMMON + extra + SHORT + ["--train-iters", str(args.iters)]
    long = MODEL + COMMON + extra + LONG + ["--train-iters", "20"]
    results = []

    references = []
    if "scaling" in parts:
        references.append(("one_gpu", short, "0", 1))
    if "context" in parts:
        references.append(("one_gpu_32k", long, "1" if references else "0", 1))
    run_all(references, args.out)
    if "scaling" in parts:
        results.append(summary(args.out, "one_gpu", None, 8 * 4096, 1))
        for name in args.scaling_layouts.split(","):
            flags = LAYOUTS[name]
            run_all([(name, short + flags, "0,1", 2)], args.out)
            results.append(summary(args.out, name, "one_gpu", 8 * 4096, 2))
    if "context" in parts:
        results.append(summary(args.out, "one_gpu_32k", None, 2 * 32768, 1))
        for name, flags in (("cp2_32k", []), ("cp2_32k_distopt", LAYOUTS["dp2_distopt"])):
            run_all([(name, long + ["--context-parallel-size", "2"] + flags, "0,1", 2)], args.out)
            results.append(summary(args.out, name, "one_gpu_32k", 2 * 32768, 2))
    if "references" in parts or "match" in parts:
        match = {"4k": MODEL + COMMON + SHORT + MATCH, "32k": MODEL + COMMON + LONG + MATCH}
        base = {shape: args.out / f"base_{shape}" for shape in match}
    if "references" in parts:
        for shape in sorted({MATCH_LAYOUTS[name][1] for name in args.layouts.split(",")}):
            flags = match[shape]
            run_all([(f"base_{shape}", flags + ["--train-iters", "22", "--exit-interval", "2", "--save",
                                                str(base[shape])], args.reference_gpu, 1)], args.out)
        for shape in sorted({MATCH_LAYOUTS[name][1] for name in args.layouts.split(",")}):
            flags = match[shape] + ["--train-iters", "22", "--load", str(base[shape]), "--save",
                                    str(args.out / f"reference_{shape}")]
            run_all([(f"reference_{shape}", flags, args.reference_gpu, 1)], args.out)
    if "match" in parts:
        for name in args.layouts.split(","):
            layout, shape = MATCH_LAYOUTS[name]
            run_all([(f"match_{name}", match[shape] + layout + ["--train-iters", "22", "--load", str(base[shape]),
                                                                "--save", str(args.out / f"match_{name}")], "0,1", 2)],
                    args.out)
            ours = loss_csv(args.out / f"match_{name}" / "loss.csv")
            reference = loss_csv(args.out / f"reference_{shape}" / "loss.csv")
            common = sorted(set(ours) & set(reference))
            results.append({"run": f"match_{name}", "compared_iterations": common,
                            "max_abs_loss_diff": max((abs(ours[i] - reference[i]) for i in common), default=None),
                            "reference": [reference[i] for i in common], "losses": [ours[i] for i in common]})
    if "optimizer" in parts:
        sharded = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                   "--timing-log-level", "2"]
        for gbs, optimizer in itertools.product(args.share_gbs.split(","), args.share_optimizers.split(",")):
            iters = args.share_iters
            flags = MODEL + COMMON + sharded + [
                "--seq-length", "4096", "--max-position-embeddings", "4096", "--micro-batch-size", args.share_mbs,
                "--global-batch-size", gbs, "--train-iters", str(iters), "--optimizer", optimizer,
            ] + (["--lr", "0.02", "--min-lr", "0.002"] if optimizer == "zaya_muon" else [])
            for gpus, nproc in (("0", 1), ("0,1", 2)):
                name = f"{optimizer}_gbs{gbs}_{'one_gpu' if nproc == 1 else 'dp2'}"
                # the profiler takes iteration iters - 2; the timing leaves it and everything after out
                run_all([(name, flags, gpus, nproc, f"{iters - 2}:1")], args.out)
                results.append(optimizer_share(args.out, name, nproc, first=args.share_warmup, last=iters - 3))
    if "resume" in parts:
        ckpt = args.out / "ckpt"
        resume = MODEL + COMMON + SHORT + MATCH + ["--use-distributed-optimizer", "--deterministic-mode",
                                                   "--train-iters", "10"]
        run_all([("distopt_uninterrupted", resume + ["--save", str(ckpt), "--save-interval", "5"], "0,1", 2)],
                args.out)
        run_all([("distopt_resumed", resume + ["--load", str(ckpt), "--ckpt-step", "5", "--save", str(ckpt) + "-b",
                                               "--save-interval", "1000"], "0,1", 2)], args.out)
        # Per-iteration losses from the loss-curve CSVs: Megatron's first log line after a resume is not.
        whole, resumed = loss_csv(ckpt / "loss.csv"), loss_csv(Path(str(ckpt) + "-b") / "loss.csv")
        results.append({"run": "distopt_resume", "resumed_iterations": sorted(resumed),
                        "exact": bool(resumed) and all(whole.get(i) == loss for i, loss in resumed.items()),
                        "losses": {i: (whole.get(i), loss) for i, loss in resumed.items()}})

    (args.out / f"parallel-{args.parts.replace(',', '-')}.json").write_text(json.dumps(results, indent=1))
    base = {r["run"]: r.get("tokens_per_s_per_gpu") for r in results if r.get("gpus") == 1}
    print("\n| run | GPUs | iterations | ms/iter (median) | tokens/s/GPU | scaling eff. | max |Δ loss| (first 20) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "gpus" not in r:
            continue
        ref = base.get("one_gpu_32k" if "32k" in r["run"] else "one_gpu")
        eff = r.get("tokens_per_s_per_gpu", 0) / ref if ref and r["gpus"] > 1 else None
        print(f"| {r['run']} | {r['gpus']} | {r['iterations']} | {r.get('ms_per_iter', float('nan')):.1f} "
              f"({r.get('ms_per_iter_median', float('nan')):.1f}) | "
              f"{r.get('tokens_per_s_per_gpu', float('nan')):,.0f} | {'' if eff is None else f'{eff:.1%}'} | "
              f"{r.get('max_abs_loss_diff', '')} |")
    for r in results:
        if "optimizer_share" in r:
            print(f"{r['run']}: {r['ms_per_iter']:.1f} ms/iter, optimizer step {r['optimizer_ms']:.1f} ms "
                  f"({r['optimizer_share']:.1%}); sub-timers {r['optimizer_subtimers_ms']}")
            if "profile" in r:
                print(f"  profiled: {json.dumps(r['profile'])}")
        if r["run"].startswith("match_"):
            print(f"{r['run']}: {len(r['compared_iterations'])} iterations, max |loss - one GPU| = "
                  f"{r['max_abs_loss_diff']}")
        if r["run"] == "distopt_resume":
            print(f"\ndistributed optimizer resume: exact={r['exact']} iterations {r['resumed_iterations']}")


if __name__ == "__main__":
    main()
