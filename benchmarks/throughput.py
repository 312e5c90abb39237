"""The training-throughput benchmark, one invocation: ZAYA1 through the real CLI, its baselines, a
per-component profile and a sequence-length sweep. Results go to --out as JSON, PNG, raw logs and a
markdown summary (also printed).

    python -m benchmarks.throughput --out runs/throughput                   # everything, one H200, ~6 min
    python -m benchmarks.throughput --out runs/t1 --parts zaya,gpt_sdpa     # a subset (see --parts)
    python -m benchmarks.throughput --out runs/smoke --smoke                # tiny shapes, CPU, ~2 min

Parts:
  zaya      ``python -m megatron_zaya.pretrain`` (through ``benchmarks.probe``): ZAYA1-8B width at --layers layers,
            mock data, bf16, sequence 4096, micro-batch 2, global batch 8; its last --profile-iters iterations
            run under torch.profiler for the per-component breakdown (and are left out of the timings).
  gpt       Megatron-Core's stock GPT-MoE (benchmarks/gpt_entry.py, local spec: unfused DotProductAttention) at
            the same width, GQA 8/2 heads, 16 top-1 SwiGLU experts, vocabulary and batch.
  gpt_sdpa  the same GPT-MoE with SDPA (flash) core attention: ``--spec benchmarks.gqa_sdpa gqa_sdpa_block_spec``.
  eager     one decoder layer forward + backward at S=4096, B=2: transformers' eager ZAYA1 layer vs ours.
  sweep     in-process training steps at sequence 4k/8k/16k/32k (32,768 tokens per step): ZAYA1 vs the
            SDPA GQA baseline; plot ``sweep.png``.
  zaya_lm_recompute  (not in the default) the zaya run with the fused LM head recomputing its logits in the
            backward (``--zaya-lm-head-backward recompute``) instead of computing its gradients in the forward.
  zaya_graphs  (not in the default) the zaya run with its layers replayed as CUDA graphs (``--zaya-cuda-graphs``).
  dp2, ep2  (two GPUs, not in the default) the zaya run under torchrun on 2 GPUs with twice the global
            batch: data parallel, and expert parallel (--expert-model-parallel-size 2); the scaling efficiency
            is their tokens/s/GPU over the zaya part's (run zaya in the same invocation).

Timings: mean of Megatron's "elapsed time per iteration" after --warmup iterations. Tokens/s/GPU =
global batch × sequence / iteration time / GPUs. TFLOP/s/GPU from ``megatron_zaya.flops`` (model FLOPs,
3 × forward, experts counted for the tokens the routers actually sent to one) — not Megatron's log line,
whose GPT formula does not know CCA's convolutions or ZAYA1's router. MFU = TFLOP/s / --peak-tflops (the
bf16 dense GEMM rate measured on the same GPU). Peak memory: torch.cuda.max_memory_allocated in the
training process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the runs start here, where ``-m benchmarks.*`` resolves

PARTS = ("zaya", "gpt", "gpt_sdpa", "eager", "sweep", "zaya_lm_recompute", "zaya_graphs", "dp2", "ep2")
DEFAULT_PARTS = PARTS[:5]  # dp2 and ep2 need two GPUs
# the zaya run with other flags: one GPU, then two (torchrun, weak scaling)
ONE_GPU_VARIANTS = {"zaya": [], "zaya_lm_recompute": ["--zaya-lm-head-backward", "recompute"],
                    "zaya_graphs": ["--zaya-cuda-graphs"]}
TWO_GPU = {"dp2": [], "ep2": ["--expert-model-parallel-size", "2"]}
ZAYA_RUNS = {**ONE_GPU_VARIANTS, **TWO_GPU}
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)"
                       r"(?:.*?throughput per GPU \(TFLOP/s/GPU\): ([\d.]+))?.*?lm loss: ([\d.E+-]+)")


def shape(smoke: bool, layers: int) -> dict:
    """The benchmarked width: ZAYA1-8B's (or the tiny preset's with --smoke)."""
    from megatron_zaya.config import preset

    values = preset("tiny" if smoke else "zaya1-8b-shallow")
    return dict(values, num_layers=layers)


def world_size(part: str) -> int:
    return 2 if part in TWO_GPU else 1


def common_flags(args, world: int = 1) -> list[str]:
    """The training flags of every CLI run; the global batch grows with the
    GPUs (weak scaling: the same micro-batches per GPU)."""
    flags = ["--seq-length", str(args.seq), "--max-position-embeddings", str(args.seq),
             "--micro-batch-size", str(args.mbs), "--global-batch-size", str(args.gbs * world),
             "--train-iters", str(args.iters), "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "5",
             "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--clip-grad", "1.0", "--log-interval", "1",
             "--log-throughput", "--eval-iters", "0", "--eval-interval", "1000", "--mock-data",
             "--tokenizer-type", "NullTokenizer", "--transformer-impl", "local", "--no-gradient-accumulation-fusion"]
    return flags + ([] if args.smoke else ["--bf16"])


def cli_command(part: str, args) -> list[str]:
    s = shape(args.smoke, args.layers)
    vocab = ["--vocab-size", str(s["vocab_size"] - 1)]  # NullTokenizer adds the EOD token
    probe = [sys.executable, "-m", "benchmarks.probe"]
    if part in TWO_GPU:  # torchrun: WORLD_SIZE set, so zaya-pretrain does not relaunch itself
        probe = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                 "-m", "benchmarks.probe"]
    if part in ZAYA_RUNS:
        preset = "tiny" if args.smoke else "zaya1-8b-shallow"
        return probe + ["-m", "megatron_zaya.pretrain", "--zaya-preset", preset, "--num-layers", str(args.layers),
                        *vocab, *common_flags(args, world_size(part)), *ZAYA_RUNS[part]]
    gpt = ["--num-layers", str(args.layers), "--hidden-size", str(s["hidden_size"]),
           "--num-attention-heads", str(s["num_attention_heads"]), "--group-query-attention",
           "--num-query-groups", str(s["num_query_groups"]), "--kv-channels", str(s["kv_channels"]),
           "--ffn-hidden-size", str(s["ffn_hidden_size"]), "--num-experts", str(s["num_moe_experts"]),
           "--moe-ffn-hidden-size", str(s["ffn_hidden_size"]), "--moe-router-topk", "1", "--moe-router-pre-softmax",
           "--moe-router-load-balancing-type", "none", "--moe-token-dispatcher-type", "alltoall", "--swiglu",
           "--normalization", "RMSNorm", "--disable-bias-linear", "--position-embedding-type", "rope",
           "--rotary-percent", "0.5", "--no-rope-fusion", "--no-masked-softmax-fusion", "--hidden-dropout", "0",
           "--attention-dropout", "0", *vocab]
    if args.smoke:  # Megatron's GPT on CPU: gloo, and none of the fusions that need CUDA
        gpt += ["--distributed-backend", "gloo", "--use-cpu-initialization", "--no-persist-layer-norm",
                "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion"]
    if part == "gpt_sdpa":
        gpt += ["--spec", "benchmarks.gqa_sdpa", "gqa_sdpa_block_spec"]
    return probe + ["-m", "benchmarks.gpt_entry", *gpt, *common_flags(args)]


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def run_logged(command: list[str], log: Path, env: dict, timeout: float) -> int | str:
    """Run ``command`` with its output in ``log``; the exit code, or "timeout"."""
    with open(log, "w") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        try:
            return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return "timeout"


def run_cli(part: str, args, budget: Budget, port: int) -> dict:
    out = Path(args.out) / part
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, ZAYA_BENCH_OUT=str(out), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if part not in TWO_GPU:
        env.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    profiled = part == "zaya" and args.profile_iters > 0
    first_profiled = args.iters - args.profile_iters  # profiled: first_profiled .. iters - 1; iters stops it
    if profiled:
        env["ZAYA_BENCH_PROFILE"] = f"{first_profiled}:{args.profile_iters}"
    command = cli_command(part, args)
    started = time.monotonic()
    code = run_logged(command, out / "train.log", env, max(1.0, min(args.part_timeout, budget.left())))
    result = {"command": " ".join(command), "exit": code, "wall_s": time.monotonic() - started}
    rows = [(int(i), float(ms), float(tf) if tf else None, float(loss))
            for i, ms, tf, loss in ITERATION.findall((out / "train.log").read_text(errors="replace"))]
    last_timed = first_profiled - 1 if profiled else args.iters
    timed = [r for r in rows if args.warmup < r[0] <= last_timed]
    result.update(iterations_logged=len(rows), timed_iterations=[r[0] for r in timed])
    for name in ("memory", "routing", "profile"):
        path = out / f"{name}.json"
        if path.exists():
            result[name] = json.loads(path.read_text())
    if not timed:
        return result
    ms = [r[1] for r in timed]
    world = world_size(part)
    tokens = args.gbs * world * args.seq
    result.update(gpus=world, ms_per_iteration=statistics.mean(ms), ms_median=statistics.median(ms),
                  ms_stdev=statistics.stdev(ms) if len(ms) > 1 else 0.0,
                  tokens_per_s_per_gpu=tokens / statistics.mean(ms) * 1e3 / world,
                  loss_first=rows[0][3], loss_last=rows[-1][3])
    if timed[0][2] is not None:
        result["megatron_tflops_line"] = statistics.mean(r[2] for r in timed)
    flops = flops_per_token(part, args, result.get("routing", {}).get("routed_fraction", 1.0))
    result.update(flops_per_token=flops, tflops_per_s_per_gpu=result["tokens_per_s_per_gpu"] * sum(flops.values()) / 1e12)
    result["mfu"] = result["tflops_per_s_per_gpu"] / args.peak_tflops
    return result


def flops_per_token(part: str, args, routed: float) -> dict:
    """Training FLOPs per token by component (megatron_zaya.flops)."""
    from megatron_zaya.config import zaya_config
    from megatron_zaya.flops import gqa_moe_forward_flops_per_token, training_flops_per_token

    s = shape(args.smoke, args.layers)
    if part in ZAYA_RUNS:
        return training_flops_per_token(zaya_config(**dict(s, max_position_embeddings=args.seq)), args.seq, routed)
    forward = gqa_moe_forward_flops_per_token(
        num_layers=args.layers, hidden_size=s["hidden_size"], num_attention_heads=s["num_attention_heads"],
        num_query_groups=s["num_query_groups"], kv_channels=s["kv_channels"], num_experts=s["num_moe_experts"],
        moe_ffn_hidden_size=s["ffn_hidden_size"], topk=1, vocab_size=s["vocab_size"], seq_length=args.seq)
    return {name: 3 * value for name, value in forward.items()}


def run_inprocess(part: str, args, budget: Budget) -> dict:
    out = Path(args.out) / part
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "benchmarks.inprocess", part, "--out", str(out), "--layers", str(args.layers)]
    command += ["--smoke"] if args.smoke else []
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    started = time.monotonic()
    code = run_logged(command, out / "run.log", env, max(1.0, min(args.part_timeout, budget.left())))
    result = {"command": " ".join(command), "exit": code, "wall_s": time.monotonic() - started}
    path = out / f"{part}.json"
    if path.exists():
        result.update(json.loads(path.read_text()))
    return result


# --------------------------------------------------------------------------------------------- reporting
def plot_sweep(sweep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, label in (("zaya", "ZAYA1 (CCA)"), ("gqa", "GPT-MoE, GQA (SDPA)")):
        points = [p for p in sweep.get(kind, []) if "tokens_per_s" in p]
        ax.plot([p["seq"] for p in points], [p["tokens_per_s"] for p in points], marker="o", label=label)
    seqs = sorted({p["seq"] for kind in ("zaya", "gqa") for p in sweep.get(kind, [])})
    per_step = {p["tokens_per_step"] for kind in ("zaya", "gqa") for p in sweep.get(kind, []) if "tokens_per_step" in p}
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqs, [f"{s // 1024}k" if s >= 1024 else str(s) for s in seqs])
    ax.set_xlabel(f"sequence length ({', '.join(f'{t:,}' for t in sorted(per_step))} tokens per step)")
    ax.set_ylabel("training tokens / s (one GPU)")
    ax.set_title(f"Training throughput vs sequence length, {sweep.get('layers')} layers")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def markdown(results: dict, args) -> str:
    lines = [f"Machine: {results['machine']}; date {results['date']}; peak {args.peak_tflops} TFLOP/s (bf16 GEMM).",
             f"Command: `{results['command']}`", ""]
    runs = {"zaya": "ZAYA1 (zaya-pretrain, kernels)",
            "zaya_lm_recompute": "ZAYA1, `--zaya-lm-head-backward recompute`",
            "zaya_graphs": "ZAYA1, `--zaya-cuda-graphs`",
            "gpt": "Megatron GPT-MoE, stock local attention", "gpt_sdpa": "Megatron GPT-MoE, SDPA attention"}
    baselines = [b for b in ("gpt", "gpt_sdpa") if "tokens_per_s_per_gpu" in results.get(b, {})]
    if any(p in results for p in runs):
        lines += [f"Sequence {args.seq}, micro-batch {args.mbs}, global batch {args.gbs}, {args.layers} layers, "
                  f"{args.iters} iterations; mean ± stdev over iterations {args.warmup + 1} to the last unprofiled one.",
                  "", "| " + " | ".join(["run", "ms / iteration", "tokens / s / GPU", "TFLOP/s / GPU (flops.py)", "MFU",
                                         "peak memory (GiB)", *(f"vs {b}" for b in baselines)]) + " |",
                  "| --- |" + " ---: |" * (5 + len(baselines))]
        for part, label in runs.items():
            r = results.get(part)
            if not r:
                continue
            if "tokens_per_s_per_gpu" not in r:
                lines.append(f"| {label} | failed (exit {r.get('exit')}, see {part}/train.log) |")
                continue
            memory = r.get("memory", {}).get("peak_allocated_gib")
            ratios = [f"{r['tokens_per_s_per_gpu'] / results[b]['tokens_per_s_per_gpu']:.2f}×" for b in baselines]
            lines.append(f"| {label} | {r['ms_per_iteration']:,.1f} ± {r['ms_stdev']:.1f} | "
                         f"{r['tokens_per_s_per_gpu']:,.0f} | {r['tflops_per_s_per_gpu']:.1f} | {100 * r['mfu']:.1f}% | "
                         f"{'–' if memory is None else f'{memory:.1f}'} |" + "".join(f" {x} |" for x in ratios))
        zaya = results.get("zaya", {})
        if "flops_per_token" in zaya:
            total = sum(zaya["flops_per_token"].values())
            parts = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in zaya["flops_per_token"].items())
            routed = zaya.get("routing", {}).get("routed_fraction", 1.0)
            lines += ["", f"ZAYA1 training GFLOP per token: {total / 1e9:.2f} ({parts}); routed fraction {routed:.4f}."]
        profile = zaya.get("profile")
        if profile:
            busy = profile["busy_ms_per_step"]
            lines += ["", f"Per-component {profile['time']} time, ms per step (iterations {profile['iterations']}, "
                      f"under the profiler; wall {profile['wall_ms_per_step']:,.1f} ms/step):", "",
                      "| component | ms / step | share |", "| --- | ---: | ---: |"]
            lines += [f"| {k} | {v:,.1f} | {100 * v / busy:.1f}% |" for k, v in profile["ms_per_step"].items()]
            lines += [f"| idle (wall − busy) | {max(profile['wall_ms_per_step'] - busy, 0):,.1f} | |"]
            unlinked = profile.get("unattributed_top_kernels_ms_per_step")
            if unlinked:
                lines += ["", "Unattributed kernels, ms per step: " +
                          ", ".join(f"`{name[:60]}` {ms:,.1f}" for name, ms in unlinked.items())]
    scaling = [p for p in TWO_GPU if "tokens_per_s_per_gpu" in results.get(p, {})]
    if scaling:
        one = results.get("zaya", {}).get("tokens_per_s_per_gpu")
        lines += ["", f"Two GPUs (global batch {2 * args.gbs}, same micro-batches per GPU); efficiency = tokens/s/GPU "
                  "against the one-GPU zaya run of this invocation:", "",
                  "| run | ms / iteration | tokens / s / GPU | MFU | peak memory (GiB) | scaling efficiency |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for part in scaling:
            r = results[part]
            memory = r.get("memory", {}).get("peak_allocated_gib")
            efficiency = f"{100 * r['tokens_per_s_per_gpu'] / one:.1f}%" if one else "– (no zaya part)"
            lines.append(f"| {part.upper()} | {r['ms_per_iteration']:,.1f} ± {r['ms_stdev']:.1f} | "
                         f"{r['tokens_per_s_per_gpu']:,.0f} | {100 * r['mfu']:.1f}% | "
                         f"{'–' if memory is None else f'{memory:.1f}'} | {efficiency} |")
    eager = results.get("eager", {})
    if "ours_ms" in eager:
        lines += ["", f"One decoder layer, forward + backward, S={eager['seq']}, B={eager['batch']}: transformers eager "
                  f"{eager['transformers_eager_ms']:.2f} ms, ours {eager['ours_ms']:.2f} ms "
                  f"({eager['layer_speedup']:.2f}×)."]
        if "ours_graphed_ms" in eager:
            lines[-1] += (f" Ours as CUDA graphs: {eager['ours_graphed_ms']:.2f} ms "
                          f"({eager['graphed_layer_speedup']:.2f}×).")
        zaya = results.get("zaya", {})
        if "tokens_per_s_per_gpu" in zaya:
            eager_model = eager["seq"] * eager["batch"] / (args.layers * eager["transformers_eager_ms"] / 1e3)
            lines.append(f"A stack of {args.layers} eager layers (layers only, no LM head or optimizer) would run "
                         f"{eager_model:,.0f} tokens/s: the CLI's full steps are "
                         f"{zaya['tokens_per_s_per_gpu'] / eager_model:.2f}× that.")
    sweep = results.get("sweep", {})
    if sweep.get("zaya"):
        lines += ["", f"Sequence sweep (in-process steps, {sweep['optimizer']}), tokens / s:", "",
                  "| sequence | micro-batch × count | ZAYA1 | GQA (SDPA) | ZAYA1 / GQA | ZAYA1 TFLOP/s | ZAYA1 peak GiB |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        gqa = {p["seq"]: p for p in sweep.get("gqa", [])}
        for p in sweep["zaya"]:
            g = gqa.get(p["seq"], {})
            if "tokens_per_s" not in p:
                lines.append(f"| {p['seq']} | | {p.get('error')} | {g.get('tokens_per_s', g.get('error', ''))} | | | |")
                continue
            ratio = f"{p['tokens_per_s'] / g['tokens_per_s']:.2f}×" if "tokens_per_s" in g else g.get("error", "")
            gqa_rate = f"{g['tokens_per_s']:,.0f}" if "tokens_per_s" in g else g.get("error", "")
            lines.append(f"| {p['seq']} | {p['micro_batch']} × {p['micro_batches']} | {p['tokens_per_s']:,.0f} | "
                         f"{gqa_rate} | {ratio} | {p['tflops_per_s']:.1f} | {p.get('peak_allocated_gib', 0):.1f} |")
        lines += ["", "![throughput vs sequence length](sweep.png)"]
    return "\n".join(lines) + "\n"


def machine() -> str:
    try:
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip().replace("\n", "; ")
    except (OSError, subprocess.TimeoutExpired):
        gpus = "no NVIDIA GPU"
    import torch

    return f"{gpus or 'no NVIDIA GPU'}, torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for JSON, PNG, logs and summary.md")
    parser.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                        help=f"comma-separated subset of {','.join(PARTS)} (default {','.join(DEFAULT_PARTS)})")
    parser.add_argument("--layers", type=int, default=8, help="depth of the ZAYA1-8B-width model (8 fits one GPU)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--mbs", type=int, default=2)
    parser.add_argument("--gbs", type=int, default=8)
    parser.add_argument("--iters", type=int, default=20, help="training iterations per CLI run")
    parser.add_argument("--warmup", type=int, default=3, help="first iterations left out of the timings")
    parser.add_argument("--profile-iters", type=int, default=2, help="iterations of the ZAYA1 run under the profiler")
    parser.add_argument("--peak-tflops", type=float, default=773.0,
                        help="bf16 dense GEMM rate of the GPU for MFU (773 measured on an H200, 2026-11-29)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop starting parts after this many seconds")
    parser.add_argument("--part-timeout", type=float, default=240.0, help="kill one part after this many seconds")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the whole pipeline")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {','.join(PARTS)}")
    if args.smoke:
        args.seq, args.mbs, args.gbs, args.layers = 64, 2, 4, min(args.layers, 2)
        args.iters, args.warmup, args.profile_iters = 6, 2, 1
    if args.iters - args.profile_iters <= args.warmup + 1:
        parser.error(f"--iters {args.iters} leaves no timed iterations after --warmup {args.warmup} and "
                     f"--profile-iters {args.profile_iters}; raise --iters")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget_s)
    results = {"machine": machine(), "date": datetime.date.today().isoformat(),
               "command": "python -m benchmarks.throughput " + " ".join(argv if argv is not None else sys.argv[1:]),
               "settings": vars(args)}
    for index, part in enumerate(parts):
        if budget.left() <= 0:
            results[part] = {"skipped": "time budget spent"}
            continue
        print(f"[throughput] {part} ...", flush=True)
        if part in ("eager", "sweep"):
            results[part] = run_inprocess(part, args, budget)
        else:
            results[part] = run_cli(part, args, budget, port=29555 + index)
        summary = {k: v for k, v in results[part].items() if not isinstance(v, (dict, list))}
        print(f"[throughput] {part}: {summary}", flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    if results.get("sweep", {}).get("zaya"):
        plot_sweep(results["sweep"], out / "sweep.png")
    text = markdown(results, args)
    (out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
