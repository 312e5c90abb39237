"""Eight-rank layouts through the real ``zaya-pretrain`` CLI: on 8 GPUs, or on CPU at tiny size.

    python -m benchmarks.eight_ranks --out OUT [--layouts ep8,dp8_muon] [--iters 20]     # CPU, gloo, ~8 min
    python -m benchmarks.eight_ranks --gpu --out OUT [--layouts ep8]                      # 8 GPUs, ~7 min per layout

* ``ep8``: expert parallel 8, 16 experts (2 per rank); world 8, so the dense part is data parallel 8. Adam
  (Megatron's).
* ``dp8_muon``: data parallel 8 with ``--use-distributed-optimizer --optimizer zaya_muon`` (each matrix's
  Newton-Schulz on one rank, the results gathered).

**Loss match.** Each layout runs against one process with the same flags and the same global batch (16
sequences: eight micro-batches of 2 accumulated on one process, one micro-batch of 2 on each of eight ranks).
Each EP rank initialises only its own experts, from its own generator, so a fresh EP run need not draw one
process's weights; hence both start from one checkpoint: one process trains ``BASE_ITERS`` iterations and
saves, then the reference and the eight-rank run load it and train ``--iters`` more. EP8 loads the weights
only, and so does its reference; DP8 loads the Muon state too (resharded from one rank to eight).

The floor (CPU default; ``--floor`` on GPUs): results depend on the order of summation, and training amplifies
such differences (Muon most: Newton-Schulz lifts a gradient's smallest singular directions to unit size). So
the reference runs a second time with one micro-batch of 16 instead of eight accumulated micro-batches of 2,
the same samples summed in another order; the eight-rank run should differ from the reference no more than
that run does.

**GPUs** (``--gpu``): the ZAYA1-8B-width model at 8 layers (``zaya1-8b-shallow``), sequence 4096, bf16; the
eight-rank runs add ``--overlap-grad-reduce`` (EP8 also the distributed optimizer with ``--overlap-param-gather``)
and train ``--iters`` (50) iterations, the reference 20. Then the throughput runs, weak scaling: one GPU at
global batch ``--throughput-gbs`` / 8 and the layout on eight at ``--throughput-gbs`` (default 256 sequences,
1M tokens: 4 micro-batches of ``--throughput-mbs`` 8 per GPU; at 2 an H200's step waits on the host's launches,
docs/benchmarks.md), ``--throughput-iters`` (8) iterations each; tokens/s/GPU, TFLOP/s
and MFU (``megatron_zaya.flops``, every token counted as routed to an expert, against ``--peak-tflops``,
773: the bf16 GEMM rate measured on an H200), scaling efficiency = eight ranks' tokens/s/GPU over one GPU's,
and the optimizer's share. The targets: efficiency ≥ 85%, Muon's share ≤ 3% at DP8, losses equal to
one GPU's for the first 20 iterations within bf16 tolerance.

Losses: Megatron's ``lm loss`` log lines (averaged over data-parallel ranks, 7 significant digits). The
loss-curve CSV (``<save>/loss.csv``) holds only the writing rank's micro-batches, so it cannot compare a
data-parallel run. Megatron's second logged iteration after a start reports the mean of the first two,
identically in every run, so the lines still compare. Timings: the mean ``elapsed time per iteration``
after the first 5 (3 in the throughput runs), and the optimizer's share (``--timing-log-level 1``'s
``optimizer`` timer, max over ranks, against the iteration time). On CPU (two cores shared by eight
processes) the times say nothing about GPUs; they are indicative only.

Writes ``OUT/<run>.log``, ``OUT/eight-ranks.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .megatron_log import iterations, optimizer_ms

WORLD, BASE_ITERS = 8, 2
SCHEDULE = ["--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
            "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", "1234", "--log-interval", "1", "--eval-iters", "0",
            "--eval-interval", "1000", "--save-interval", "1000", "--no-load-rng", "--timing-log-level", "1"]
CPU = ["--zaya-preset", "tiny", "--mock-data", "--seq-length", "64", "--micro-batch-size", "2"]
GPU = ["--zaya-preset", "zaya1-8b-shallow", "--vocab-size", "262271", "--mock-data", "--tokenizer-type",
       "NullTokenizer", "--seq-length", "4096", "--max-position-embeddings", "4096", "--micro-batch-size", "2",
       "--bf16"]
# name -> (model and optimizer flags of all runs, eight-rank-only flags, on GPUs also, load the optimizer state)
LAYOUTS = {
    "ep8": (["--num-experts", "16"], ["--expert-model-parallel-size", "8"],
            ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"], False),
    "dp8_muon": (["--optimizer", "zaya_muon"], ["--use-distributed-optimizer"], ["--overlap-grad-reduce"], True),
}


def pretrain(name: str, flags: list[str], out: Path, nproc: int, gpu: bool) -> None:
    """One ``zaya-pretrain`` run (under ``torch.distributed.run`` for several processes), logged to ``OUT/name.log``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not gpu:  # eight processes share the CPU cores
        env["OMP_NUM_THREADS"] = "1" if nproc > 1 else "2"
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
    return iterations(text), optimizer_ms(text)


def timing(rows: dict[int, tuple[float, float]], optimizer_ms: list[float], skip: int = 5) -> dict:
    """Mean iteration and optimizer ms after the first ``skip`` logged iterations (all but the last if fewer)."""
    skip = min(skip, len(rows) - 1)
    iteration_ms = [ms for _, (ms, _) in sorted(rows.items())][skip:]
    optimizer = optimizer_ms[skip:len(rows)]
    mean_ms = statistics.mean(iteration_ms)
    return {"ms_per_iter": mean_ms, "optimizer_ms": statistics.mean(optimizer) if optimizer else None,
            "optimizer_share": statistics.mean(optimizer) / mean_ms if optimizer else None}


def compare(name: str, reference: str, out: Path) -> dict:
    """``name``'s losses and timings against the run ``reference`` (one process)."""
    ours, our_optimizer = parse(out / f"{name}.log")
    ref, ref_optimizer = parse(out / f"{reference}.log")
    common = sorted(set(ours) & set(ref))
    differences = [abs(ours[i][1] - ref[i][1]) for i in common]
    relative = [d / abs(ref[i][1]) for d, i in zip(differences, common, strict=True)]
    return {"run": name, "iterations": common, "losses": [ours[i][1] for i in common],
            "reference_losses": [ref[i][1] for i in common], "max_abs_loss_diff": max(differences),
            "max_rel_loss_diff": max(relative), "eight_ranks": timing(ours, our_optimizer),
            "one_process": timing(ref, ref_optimizer)}


def throughput(name: str, out: Path, gbs: int, seq: int, gpus: int, flops_per_token: float,
               peak_tflops: float) -> dict:
    """Tokens/s/GPU, TFLOP/s/GPU, MFU and the optimizer's share of a throughput run (iterations after the 3rd)."""
    rows, optimizer = parse(out / f"{name}.log")
    result = timing(rows, optimizer, skip=3)
    tokens_per_s = gbs * seq / (result["ms_per_iter"] / 1e3) / gpus
    return {**result, "run": name, "gpus": gpus, "global_batch": gbs, "tokens_per_s_per_gpu": tokens_per_s,
            "tflops_per_gpu": tokens_per_s * flops_per_token / 1e12,
            "mfu": tokens_per_s * flops_per_token / 1e12 / peak_tflops}


def model_flops_per_token(gpu: bool, seq: int) -> float:
    """Training FLOPs per token of the benchmarked model (every token routed to an expert)."""
    from megatron_zaya.config import zaya_config
    from megatron_zaya.flops import training_flops_per_token

    cfg = zaya_config("zaya1-8b-shallow" if gpu else "tiny", max_position_embeddings=seq)
    return sum(training_flops_per_token(cfg, seq).values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gpu", action="store_true", help="8 GPUs, ZAYA1-8B width (default: CPU, tiny)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--iters", type=int, default=None, help="eight-rank iterations (CPU 20, GPU 50)")
    parser.add_argument("--reference-iters", type=int, default=None, help="one-process iterations (CPU 20, GPU 20)")
    parser.add_argument("--floor", action=argparse.BooleanOptionalAction, default=None,
                        help="also the reference with another micro-batch size (default: on CPU only)")
    parser.add_argument("--throughput-gbs", type=int, default=None,
                        help="global batch of the eight-rank throughput run; one GPU runs an eighth (GPU 256; "
                             "0 skips them; default off on CPU)")
    parser.add_argument("--throughput-iters", type=int, default=8)
    parser.add_argument("--throughput-mbs", type=int, default=None,
                        help="micro-batch size of the throughput runs (GPU 8, CPU 2)")
    parser.add_argument("--peak-tflops", type=float, default=773.0)
    args = parser.parse_args()
    iters = args.iters or (50 if args.gpu else 20)
    reference_iters = args.reference_iters or 20
    floor = args.floor if args.floor is not None else not args.gpu
    throughput_gbs = args.throughput_gbs if args.throughput_gbs is not None else (256 if args.gpu else 0)
    args.out.mkdir(parents=True, exist_ok=True)
    common = (GPU if args.gpu else CPU) + SCHEDULE
    results = []
    for name in args.layouts.split(","):
        model, layout, gpu_layout, load_optimizer = LAYOUTS[name]
        eight = layout + (gpu_layout if args.gpu else [])
        base = args.out / f"{name}_base"
        # one schedule (--train-iters) for every run of the layout, so the learning rates agree
        flags = common + model + ["--global-batch-size", "16", "--train-iters", str(BASE_ITERS + iters)]
        pretrain(f"{name}_base", flags + ["--exit-interval", str(BASE_ITERS), "--save", str(base)], args.out, 1,
                 args.gpu)
        resume = flags + ["--load", str(base)] + ([] if load_optimizer else ["--no-load-optim"])
        stop = ["--exit-interval", str(BASE_ITERS + reference_iters)] if reference_iters < iters else []
        pretrain(f"{name}_reference", resume + stop, args.out, 1, args.gpu)
        if floor:
            pretrain(f"{name}_floor", resume + stop + ["--micro-batch-size", "1" if args.gpu else "16"], args.out, 1,
                     args.gpu)
        pretrain(name, resume + eight, args.out, WORLD, args.gpu)
        row = compare(name, f"{name}_reference", args.out)
        row["floor"] = compare(f"{name}_floor", f"{name}_reference", args.out)["max_abs_loss_diff"] if floor else None
        if throughput_gbs:
            seq = int(common[common.index("--seq-length") + 1])
            flops = model_flops_per_token(args.gpu, seq)
            mbs = args.throughput_mbs or (8 if args.gpu else 2)
            fresh = common + model + ["--train-iters", str(args.throughput_iters), "--micro-batch-size", str(mbs)]
            pretrain(f"{name}_throughput_one", fresh + ["--global-batch-size", str(throughput_gbs // WORLD)],
                     args.out, 1, args.gpu)
            pretrain(f"{name}_throughput", fresh + eight + ["--global-batch-size", str(throughput_gbs)], args.out,
                     WORLD, args.gpu)
            one = throughput(f"{name}_throughput_one", args.out, throughput_gbs // WORLD, seq, 1, flops,
                             args.peak_tflops)
            many = throughput(f"{name}_throughput", args.out, throughput_gbs, seq, WORLD, flops, args.peak_tflops)
            row["throughput"] = {"one": one, "eight": many,
                                 "scaling_efficiency": many["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"]}
        results.append(row)
        (args.out / "eight-ranks.json").write_text(json.dumps(results, indent=1))

    print("\n| layout | iterations | max abs Δ loss | max rel Δ loss | floor: abs Δ, other micro-batch | "
          "ms/iter 1 proc | ms/iter 8 ranks | optimizer share 1 proc | optimizer share 8 ranks |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        one, eight = r["one_process"], r["eight_ranks"]
        floor_text = "" if r["floor"] is None else f"{r['floor']:.1e}"
        print(f"| {r['run']} | {r['iterations'][0]}-{r['iterations'][-1]} | {r['max_abs_loss_diff']:.1e} | "
              f"{r['max_rel_loss_diff']:.1e} | {floor_text} | {one['ms_per_iter']:.0f} | "
              f"{eight['ms_per_iter']:.0f} | {one['optimizer_share']:.1%} | {eight['optimizer_share']:.1%} |")
    if any("throughput" in r for r in results):
        print("\n| layout | GPUs | global batch | ms/iter | tokens/s/GPU | TFLOP/s/GPU | MFU | optimizer share | "
              "scaling efficiency |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in results:
            t = r.get("throughput")
            for key in ("one", "eight") if t else ():
                x = t[key]
                efficiency = f"{t['scaling_efficiency']:.1%}" if key == "eight" else ""
                print(f"| {r['run']} | {x['gpus']} | {x['global_batch']} | {x['ms_per_iter']:.0f} | "
                      f"{x['tokens_per_s_per_gpu']:,.0f} | {x['tflops_per_gpu']:.1f} | {x['mfu']:.1%} | "
                      f"{x['optimizer_share']:.1%} | {efficiency} |")


if __name__ == "__main__":
    main()
