"""The training-throughput benchmark, one invocation: ZAYA1 through the real CLI, its baselines, a
per-component profile and a sequence-length sweep. Results go to --out as JSON, PNG, raw logs and a
markdown summary (also printed).

    python -m benchmarks.throughput --out runs/throughput                   # everything, one H200, ~6 min
    python -m benchmarks.throughput --out runs/t1 --parts zaya,gpt_sdpa     # a subset (see --parts)
    python -m benchmarks.throughput --out runs/smoke --smoke                # tiny shapes, CPU, ~2 min
    python -m benchmarks.throughput --out runs/rd --parts real_depth,real_depth_graphs  # 40 layers, ~8 min

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
  real_depth  (not in the default) the released ZAYA1-8B, 40 layers, through the CLI: sequence 4096, global
            batch --real-depth-gbs (128), zaya_muon, with the settings that fit it on one H200 (ZeRO-1, bf16 Muon
            momentum, bf16 gradient reduction, selective recomputation), at the largest micro-batch that the memory
            planner (``--zaya-memory-plan``) fits on this GPU and that divides the global batch (or
            --real-depth-mbs); Megatron's level-2 timers and :class:`PhaseClock` give the step breakdown.
  real_depth_graphs  (not in the default) the same with ``--zaya-cuda-graphs`` (planned again: what the graphs
            keep reserved).

Timings: mean of Megatron's "elapsed time per iteration" after --warmup iterations. Tokens/s/GPU =
global batch × sequence / iteration time / GPUs. TFLOP/s/GPU from ``megatron_zaya.flops`` (model FLOPs,
3 × forward, experts counted for the tokens the routers actually sent to one) — not Megatron's log line,
whose GPT formula does not know CCA's convolutions or ZAYA1's router. MFU = TFLOP/s / --peak-tflops (the
bf16 dense GEMM rate measured on the same GPU). Peak memory: torch.cuda.max_memory_allocated and _reserved in the
training process.

Real-depth parts: the mean over iterations after --real-depth-warmup; MFU against --peak-tflops (773, measured)
and --datasheet-tflops (989). The step breakdown, ms per step, every row from the same run:
  layers, LM head + loss   :class:`PhaseClock`, in the training process: events at the decoder's and the model's
                           boundaries, forward and backward, summed over the micro-batches;
  optimizer                Megatron's ``optimizer`` timer;
  host and data            iteration time − the three above, split into data, embedding and loss function
                           (forward-compute + backward-compute − layers − LM head), the schedule and gradient
                           finalization (forward-backward − forward-compute − backward-compute), and the training
                           loop (iteration − forward-backward − optimizer).
Megatron's level-2 timers synchronize the device where each micro-batch's forward and backward start and end, so the host
loses its lead there (a launch latency per micro-batch).
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

PARTS = ("zaya", "gpt", "gpt_sdpa", "eager", "sweep", "zaya_lm_recompute", "zaya_graphs", "dp2", "ep2", "real_depth",
         "real_depth_graphs")
DEFAULT_PARTS = PARTS[:5]  # dp2 and ep2 need two GPUs
# the zaya run with other flags: one GPU, then two (torchrun, weak scaling)
ONE_GPU_VARIANTS = {"zaya": [], "zaya_lm_recompute": ["--zaya-lm-head-backward", "recompute"],
                    "zaya_graphs": ["--zaya-cuda-graphs"]}
TWO_GPU = {"dp2": [], "ep2": ["--expert-model-parallel-size", "2"]}
ZAYA_RUNS = {**ONE_GPU_VARIANTS, **TWO_GPU}
# ZAYA1-8B at its 40 layers, eager and graphed, with the settings that fit it on one H200 (docs/benchmarks.md,
# "ZAYA1-8B at 40 layers"): ZeRO-1, bf16 Muon momentum, bf16 gradient reduction, selective recomputation.
REAL_DEPTH = {"real_depth": [], "real_depth_graphs": ["--zaya-cuda-graphs"]}
REAL_DEPTH_SETTINGS = ["--use-distributed-optimizer", "--zaya-muon-momentum-dtype", "bf16", "--grad-reduce-in-bf16",
                       "--recompute-granularity", "selective"]
# Level 2 adds forward-compute and backward-compute (summed over the micro-batches) to forward-backward and optimizer.
TIMER_FLAGS = ["--timing-log-level", "2", "--timing-log-option", "max"]
TIMER = re.compile(r"^\s+([\w/-]+) \.+: (?:\([0-9.]+, )?([0-9.]+)\)?\s*$")  # "max", or "minmax": its max
PLAN_TOTALS = re.compile(r"^\s+(between steps|peak)\s+([0-9.]+) GiB$", re.MULTILINE)
PLAN_LARGEST = re.compile(r"largest micro-batch on (\S+)\s+\(\d+ GiB\): (\d+)")
PHASES_ENTRY = "--train-with-phases"  # the first argument that makes this module the training entry
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
             "--tokenizer-type", "NullTokenizer", "--transformer-impl", "local"]
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
    rows = iteration_rows((out / "train.log").read_text(errors="replace"))
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


def iteration_rows(text: str) -> list[tuple[int, float, float | None, float]]:
    """(iteration, ms, Megatron's TFLOP/s line or None, lm loss) of each logged iteration, in log order."""
    return [(int(i), float(ms), float(tf) if tf else None, float(loss)) for i, ms, tf, loss in ITERATION.findall(text)]


def flops_per_token(part: str, args, routed: float) -> dict:
    """Training FLOPs per token by component (megatron_zaya.flops)."""
    from megatron_zaya.config import preset, zaya_config
    from megatron_zaya.flops import gqa_moe_forward_flops_per_token, training_flops_per_token

    s = preset(real_depth_preset(args.smoke)) if part in REAL_DEPTH else shape(args.smoke, args.layers)
    if part in ZAYA_RUNS or part in REAL_DEPTH:
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


# -------------------------------------------------------------------------------------------- real depth
def real_depth_preset(smoke: bool) -> str:
    return "test" if smoke else "zaya1-8b"


def real_depth_command(part: str, args, micro_batch: int) -> list[str]:
    """``zaya-pretrain`` arguments of a real-depth part: the 40-layer command of docs/benchmarks.md with the
    settings that fit it (the ``test`` preset with --smoke), at --real-depth-gbs, with Megatron's level-2 timers."""
    return ["-m", "megatron_zaya.pretrain", "--zaya-preset", real_depth_preset(args.smoke), "--mock-data",
            "--seq-length", str(args.seq), "--global-batch-size", str(args.real_depth_gbs),
            "--micro-batch-size", str(micro_batch), *([] if args.smoke else ["--bf16"]), "--optimizer", "zaya_muon",
            "--train-iters", str(args.real_depth_iters), "--log-interval", "1", "--eval-iters", "0", "--lr", "3e-4",
            "--lr-warmup-iters", "1", *REAL_DEPTH_SETTINGS, *TIMER_FLAGS, *REAL_DEPTH[part]]


def nvidia_gpus(fields: str = "name") -> list[str]:
    """One line of ``fields`` per NVIDIA GPU, from nvidia-smi (none without it): asking torch would give this
    process a CUDA context, memory the training process then lacks."""
    try:
        found = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in found.splitlines() if line.strip()]


def memory_plan(command: list[str], env: dict, log: Path, timeout: float) -> dict:
    """The memory planner on ``command`` (``--zaya-memory-plan 1``, which builds nothing): its peak and memory
    between steps at the command's micro-batch, GiB, and the largest micro-batch that fits, per GPU type."""
    code = run_logged([sys.executable, *command, "--zaya-memory-plan", "1"], log, env, timeout)
    return dict(parse_plan(log.read_text(errors="replace")), exit=code)


def parse_plan(text: str) -> dict:
    """``memory_plan.report``'s text: ``largest`` ``{GPU type: micro-batch}``, ``peak_gib``, ``between_steps_gib``."""
    plan = {"largest": {gpu: int(n) for gpu, n in PLAN_LARGEST.findall(text)}}
    plan.update({name.replace(" ", "_") + "_gib": float(gib) for name, gib in PLAN_TOTALS.findall(text)})
    return plan


def choose_micro_batch(part: str, args, env: dict, out: Path, budget: Budget) -> dict:
    """The micro-batch of a real-depth run: --real-depth-mbs, else the largest that the memory planner fits on
    this GPU and that divides the global batch (a step is whole micro-batches; with --smoke at most 2, so that a
    step has several). ``plan``: the planner at the chosen micro-batch; ``error``: why there is none."""
    timeout = max(1.0, min(args.real_depth_timeout, budget.left()))
    if args.real_depth_mbs:
        plan = memory_plan(real_depth_command(part, args, args.real_depth_mbs), env, out / "plan.log", timeout)
        return {"micro_batch": args.real_depth_mbs, "why": "--real-depth-mbs", "plan": plan}
    names = nvidia_gpus()
    from megatron_zaya.memory_plan import GPUS_GIB

    gpu = next((g for g in GPUS_GIB if names and g in names[0]), "H200" if args.smoke and not names else None)
    if gpu is None:
        return {"error": f"no memory plan for GPU {names[0] if names else '(none)'}; pass --real-depth-mbs"}
    plan = memory_plan(real_depth_command(part, args, 1), env, out / "plan.log", timeout)
    largest = plan["largest"].get(gpu)
    if not largest:
        return {"error": f"the memory planner fits no micro-batch on an {gpu} (exit {plan['exit']}, see "
                         f"{part}/plan.log)", "plan": plan}
    gbs = args.real_depth_gbs
    micro_batch = max(m for m in range(1, min(largest, 2 if args.smoke else largest) + 1) if gbs % m == 0)
    why = (f"the memory plan's largest on an {gpu} is {largest}; {micro_batch} is the largest at most that which "
           f"divides the global batch {gbs}" + (" (--smoke: at most 2)" if args.smoke else ""))
    if micro_batch != 1:
        plan = dict(memory_plan(real_depth_command(part, args, micro_batch), env, out / "plan.log", timeout),
                    largest=plan["largest"])
    return {"micro_batch": micro_batch, "why": why, "gpu": gpu, "plan": plan}


def run_real_depth(part: str, args, budget: Budget, port: int) -> dict:
    """A real-depth part: plan the micro-batch, then train under the probe (memory, routing) and
    :class:`PhaseClock` (layers, LM head), and read Megatron's iteration lines and timers."""
    out = Path(args.out) / part
    out.mkdir(parents=True, exist_ok=True)
    if REAL_DEPTH[part] and not nvidia_gpus():
        return {"skipped": "CUDA graphs need a GPU"}
    env = dict(os.environ, ZAYA_BENCH_OUT=str(out), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="1",
               RANK="0", LOCAL_RANK="0")
    result = choose_micro_batch(part, args, env, out, budget)
    if "error" in result:
        return result
    print(f"[throughput] {part}: micro-batch {result['micro_batch']} ({result['why']}; planned peak "
          f"{result['plan'].get('peak_gib', float('nan')):.1f} GiB)", flush=True)
    command = [sys.executable, "-m", "benchmarks.throughput", PHASES_ENTRY,
               *real_depth_command(part, args, result["micro_batch"])]
    started = time.monotonic()
    code = run_logged(command, out / "train.log", env, max(1.0, min(args.real_depth_timeout, budget.left())))
    result.update(command=" ".join(command), exit=code, wall_s=time.monotonic() - started)
    for name in ("memory", "routing", "phases"):
        path = out / f"{name}.json"
        if path.exists():
            result[name] = json.loads(path.read_text())
    text = (out / "train.log").read_text(errors="replace")
    if "phases" not in result or not iteration_rows(text):
        return result
    result.update(real_depth_summary(text, result["phases"], args.real_depth_warmup,
                                     args.real_depth_gbs * args.seq))
    if "ms_per_iteration" not in result:
        return result
    flops = flops_per_token(part, args, result.get("routing", {}).get("routed_fraction", 1.0))
    tflops = result["tokens_per_s_per_gpu"] * sum(flops.values()) / 1e12
    result.update(flops_per_token=flops, tflops_per_s_per_gpu=tflops, mfu=tflops / args.peak_tflops,
                  mfu_datasheet=tflops / args.datasheet_tflops)
    return result


def timers_by_iteration(text: str) -> dict[int, dict[str, float]]:
    """Megatron's timer block after each logged iteration (--timing-log-level >= 1), ``{iteration: {timer:
    ms}}``; with ``--timing-log-option minmax`` the max over ranks."""
    blocks, current = {}, None
    for line in text.splitlines():
        iteration = ITERATION.search(line)
        if iteration:
            current = blocks.setdefault(int(iteration.group(1)), {})
            continue
        timer = TIMER.match(line)
        if timer and current is not None:
            current[timer.group(1)] = float(timer.group(2))
    return blocks


def real_depth_summary(text: str, phases: dict, warmup: int, tokens_per_step: int) -> dict:
    """Step time, tokens/s and the step breakdown, ms per step, of the iterations after ``warmup``: the mean
    over them of each row (see BREAKDOWN), all from one run's log and its ``phases.json``."""
    rows = iteration_rows(text)
    timers = timers_by_iteration(text)
    per_iteration = phases["iterations"]
    timed = [r for r in rows if r[0] > warmup and str(r[0]) in per_iteration and "optimizer" in timers.get(r[0], {})]
    if not timed:
        return {"iterations_logged": len(rows), "timed_iterations": []}
    ms = [r[1] for r in timed]
    rows_ms = []
    for iteration, step, _, _ in timed:
        t, p = timers[iteration], per_iteration[str(iteration)]
        compute = t["forward-compute"] + t["backward-compute"]
        rows_ms.append({
            "layers": p["layers_ms"], "lm_head": p["lm_head_ms"], "optimizer": t["optimizer"],
            "host_and_data": step - p["layers_ms"] - p["lm_head_ms"] - t["optimizer"],
            "data_embedding_loss": compute - p["layers_ms"] - p["lm_head_ms"],
            "schedule_grad_finalize": t["forward-backward"] - compute,
            "training_loop": step - t["forward-backward"] - t["optimizer"],
            "iteration": step})
    mean = statistics.mean(ms)
    return {"iterations_logged": len(rows), "timed_iterations": [r[0] for r in timed],
            "micro_batches_per_step": [per_iteration[str(r[0])]["micro_batches"] for r in timed],
            "ms_per_iteration": mean, "ms_stdev": statistics.stdev(ms) if len(ms) > 1 else 0.0,
            "tokens_per_s_per_gpu": tokens_per_step / mean * 1e3, "loss_first": rows[0][3], "loss_last": rows[-1][3],
            "breakdown_ms": {k: statistics.mean(r[k] for r in rows_ms) for k in rows_ms[0]}}


class PhaseClock:
    """Each training micro-batch's decoder layers and LM head + loss, forward and backward, timed inside the
    training process (``--train-with-phases``) by torch's global module hooks and gradient hooks:

    forward:  [decoder called, decoder returned] is the layers', [decoder returned, model returned] the LM head
              and loss's (the fused head computes its gradients there: ``lm_head_grad_in_forward``);
    backward: [gradient of the model's output, gradient of the decoder's output] is the LM head's, [gradient of
              the decoder's output, gradient of the decoder's input] the layers'.

    On a GPU each boundary is a CUDA event recorded on the current stream (no host sync; read at exit), so an
    interval is the device timeline between two points of the stream, idle time waiting for the host's launches
    included; on CPU the host clock. ``DIR/phases.json``: per iteration, the micro-batches and the layers' and the
    LM head's ms summed over them.
    """

    BOUNDARIES = ("layers_start", "layers_end", "lm_head_end", "lm_head_backward_start", "lm_head_backward_end",
                  "layers_backward_end")

    def __init__(self, out: Path):
        import torch

        self.out = out
        self.cuda = torch.cuda.is_available()
        self.micro_batches: list[tuple[int, dict]] = []

    def mark(self, marks: dict, name: str) -> None:
        if self.cuda:
            import torch

            marks[name] = torch.cuda.Event(enable_timing=True)
            marks[name].record()
        else:
            marks[name] = time.perf_counter()

    def on_grad(self, marks: dict, name: str):
        return lambda grad: self.mark(marks, name)

    def pre_forward(self, module, args):
        import torch

        from benchmarks.probe import capturing, megatron_iteration

        if not torch.is_grad_enabled() or capturing():
            return
        name = type(module).__name__
        if name == "ZayaModel":
            self.micro_batches.append((megatron_iteration(), {}))
        elif name == "ZayaTransformerBlock" and self.micro_batches and args and getattr(args[0], "requires_grad", 0):
            marks = self.micro_batches[-1][1]
            self.mark(marks, "layers_start")
            args[0].register_hook(self.on_grad(marks, "layers_backward_end"))

    def post_forward(self, module, args, output):
        name = type(module).__name__
        if name not in ("ZayaModel", "ZayaTransformerBlock") or not self.micro_batches:
            return
        marks = self.micro_batches[-1][1]
        if "layers_start" not in marks or not getattr(output, "requires_grad", False):
            return
        end, backward = ("layers_end", "lm_head_backward_end") if name == "ZayaTransformerBlock" else \
            ("lm_head_end", "lm_head_backward_start")
        self.mark(marks, end)
        output.register_hook(self.on_grad(marks, backward))

    def write(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        iterations = {}
        for iteration, marks in self.micro_batches:
            if set(marks) != set(self.BOUNDARIES):  # a forward without its backward
                continue

            def ms(a, b):
                return marks[a].elapsed_time(marks[b]) if self.cuda else 1e3 * (marks[b] - marks[a])

            row = iterations.setdefault(str(iteration), {"micro_batches": 0, "layers_ms": 0.0, "lm_head_ms": 0.0})
            row["micro_batches"] += 1
            row["layers_ms"] += ms("layers_start", "layers_end") + ms("lm_head_backward_end", "layers_backward_end")
            row["lm_head_ms"] += ms("layers_end", "lm_head_end") + ms("lm_head_backward_start", "lm_head_backward_end")
        clock = "CUDA events" if self.cuda else "host clock"
        (self.out / "phases.json").write_text(json.dumps({"clock": clock, "iterations": iterations}, indent=1))


def train_with_phases(argv: list[str]) -> int:
    """``python -m benchmarks.throughput --train-with-phases -m megatron_zaya.pretrain ARGS``: the training entry
    under ``benchmarks.probe`` and a :class:`PhaseClock` (writing to $ZAYA_BENCH_OUT)."""
    import atexit

    import torch

    from benchmarks import probe

    clock = PhaseClock(Path(os.environ["ZAYA_BENCH_OUT"]))
    torch.nn.modules.module.register_module_forward_pre_hook(clock.pre_forward)
    torch.nn.modules.module.register_module_forward_hook(clock.post_forward)
    atexit.register(clock.write)
    probe.main(argv)
    return 0


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


# Rows of the real-depth step breakdown: (key, label, how it is derived). All from the same run.
BREAKDOWN = (
    ("layers", "layers", "the decoder's forward + backward, between events at its boundaries, summed over the "
     "micro-batches (`PhaseClock`)"),
    ("lm_head", "LM head + loss", "the LM head and loss: forward (the fused head computes its gradients there) + "
     "backward, the same way"),
    ("optimizer", "optimizer", "Megatron's `optimizer` timer"),
    ("host_and_data", "host and data", "iteration − layers − LM head − optimizer: the three rows below"),
    ("data_embedding_loss", "· data, embedding, loss function", "`forward-compute` + `backward-compute` − layers − "
     "LM head"),
    ("schedule_grad_finalize", "· schedule, gradient finalization", "`forward-backward` − `forward-compute` − "
     "`backward-compute`"),
    ("training_loop", "· training loop", "iteration − `forward-backward` − `optimizer`"),
    ("iteration", "iteration", "Megatron's elapsed time per iteration"),
)


def real_depth_markdown(results: dict, args) -> list[str]:
    """The real-depth parts' table, their eager / graphs ratio and their step breakdowns."""
    labels = {"real_depth": "eager", "real_depth_graphs": "`--zaya-cuda-graphs`"}
    ran = [p for p in REAL_DEPTH if p in results]
    if not ran:
        return []
    tokens = args.real_depth_gbs * args.seq
    model = "the `test` preset (--smoke)" if args.smoke else "ZAYA1-8B at 40 layers"
    lines = ["", f"Real depth: {model} through the CLI, sequence {args.seq}, "
             f"global batch {args.real_depth_gbs} ({tokens:,} tokens per step), `--optimizer zaya_muon`, "
             f"`{' '.join(REAL_DEPTH_SETTINGS)}`; mean ± stdev over iterations {args.real_depth_warmup + 1} to "
             f"{args.real_depth_iters}. MFU: `megatron_zaya/flops.py` model FLOPs against {args.peak_tflops:g} "
             f"(the measured GEMM rate) and {args.datasheet_tflops:g} TFLOP/s (datasheet).", "",
             "| run | micro-batch | ms / step | tokens / s / GPU | MFU vs {:g} | MFU vs {:g} | peak GiB: allocated / "
             "reserved / planned |".format(args.peak_tflops, args.datasheet_tflops),
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for part in ran:
        r = results[part]
        if "tokens_per_s_per_gpu" not in r:
            why = r.get("skipped") or r.get("error") or f"failed (exit {r.get('exit')}, see {part}/train.log)"
            lines.append(f"| {labels[part]} | {why} |")
            continue
        largest = r["plan"].get("largest", {}).get(r.get("gpu"))
        chosen = f"{r['micro_batch']}" + (f" (plan's largest: {largest})" if largest else " (given)")
        memory = r.get("memory", {})
        peaks = " / ".join("–" if memory.get(key) is None else f"{memory[key]:.1f}"
                           for key in ("peak_allocated_gib", "peak_reserved_gib"))
        lines.append(f"| {labels[part]} | {chosen} | {r['ms_per_iteration']:,.0f} ± {r['ms_stdev']:,.0f} | "
                     f"{r['tokens_per_s_per_gpu']:,.0f} | {100 * r['mfu']:.1f}% | {100 * r['mfu_datasheet']:.1f}% | "
                     f"{peaks} / {r['plan'].get('peak_gib', float('nan')):.1f} |")
    retries = {labels[p]: results[p]["memory"]["alloc_retries"] for p in ran
               if "alloc_retries" in results[p].get("memory", {})}
    if retries:
        lines += ["", "The caching allocator's retries over the run (each frees its cached blocks and waits for the "
                  "device): " + ", ".join(f"{label} {count}" for label, count in retries.items()) + "."]
    done = [p for p in ran if "breakdown_ms" in results[p]]
    if len(done) == 2:
        eager, graphs = (results[p]["tokens_per_s_per_gpu"] for p in REAL_DEPTH)
        lines += ["", f"Eager reaches {eager / graphs:.2f}× the graphed tokens/s."]
    if done:
        header = "".join(f" {labels[p]} ms | share |" for p in done)
        clocks = sorted({results[p]["phases"]["clock"] for p in done})
        lines += ["", "Step breakdown, ms per step (the same iterations; every row from the same run's log and "
                  f"`phases.json`, whose layers and LM head are timed by {' / '.join(clocks)}):", "",
                  f"| row |{header} how |", "| --- |" + " ---: | ---: |" * len(done) + " --- |"]
        for key, label, how in BREAKDOWN:
            cells = "".join(f" {results[p]['breakdown_ms'][key]:,.0f} | "
                            f"{100 * results[p]['breakdown_ms'][key] / results[p]['ms_per_iteration']:.1f}% |"
                            for p in done)
            lines.append(f"| {label} |{cells} {how} |")
    return lines


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
    lines += real_depth_markdown(results, args)
    return "\n".join(lines) + "\n"


def machine() -> str:
    import torch

    return f"{'; '.join(nvidia_gpus('name,memory.total')) or 'no NVIDIA GPU'}, torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [PHASES_ENTRY]:
        return train_with_phases(argv[1:])
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
    parser.add_argument("--datasheet-tflops", type=float, default=989.0,
                        help="the GPU's datasheet dense bf16 peak, the second MFU of the real-depth parts (H200: 989)")
    parser.add_argument("--real-depth-gbs", type=int, default=128,
                        help="global batch of the real-depth parts (128 x 4096 = 524k tokens per step)")
    parser.add_argument("--real-depth-mbs", type=int, default=0,
                        help="micro-batch of the real-depth parts (default: the largest the memory planner fits)")
    parser.add_argument("--real-depth-iters", type=int, default=4, help="training iterations per real-depth part")
    parser.add_argument("--real-depth-warmup", type=int, default=1,
                        help="first real-depth iterations left out of the timings (the first compiles and captures)")
    parser.add_argument("--real-depth-timeout", type=float, default=420.0,
                        help="kill a real-depth run (or its memory plan) after this many seconds")
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
        args.real_depth_gbs, args.real_depth_iters, args.real_depth_warmup = 8, 3, 1
    if args.iters - args.profile_iters <= args.warmup + 1:
        parser.error(f"--iters {args.iters} leaves no timed iterations after --warmup {args.warmup} and "
                     f"--profile-iters {args.profile_iters}; raise --iters")
    if args.real_depth_iters <= args.real_depth_warmup:
        parser.error(f"--real-depth-iters {args.real_depth_iters} leaves no timed iterations after "
                     f"--real-depth-warmup {args.real_depth_warmup}; raise --real-depth-iters")
    if args.real_depth_mbs and args.real_depth_gbs % args.real_depth_mbs:
        parser.error(f"--real-depth-mbs {args.real_depth_mbs} does not divide --real-depth-gbs "
                     f"{args.real_depth_gbs}; give a divisor")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget_s)
    results = {"machine": machine(), "date": datetime.date.today().isoformat(),
               "command": "python -m benchmarks.throughput " + " ".join(argv),
               "settings": vars(args)}
    for index, part in enumerate(parts):
        if budget.left() <= 0:
            results[part] = {"skipped": "time budget spent"}
            continue
        print(f"[throughput] {part} ...", flush=True)
        if part in ("eager", "sweep"):
            results[part] = run_inprocess(part, args, budget)
        elif part in REAL_DEPTH:
            results[part] = run_real_depth(part, args, budget, port=29555 + index)
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
