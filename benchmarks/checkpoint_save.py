"""What a checkpoint save costs the training loop, by tier: ``python -m benchmarks.checkpoint_save``.

Trains ZAYA1 (``zaya1-8b-shallow``: ZAYA1-8B's width, 8 layers; ``--num-layers`` for deeper) through the real
``zaya-pretrain`` CLI once per mode, on mock data with bf16 and Muon, saving every ``--interval`` steps:

* ``none``: no save (the baseline iteration time);
* ``sync``: Megatron's synchronous ``torch_dist`` save to ``--save`` (``--dir``);
* ``async``: the same with ``--async-save`` (Megatron's background writer);
* ``local``: the local tier (``--non-persistent-ckpt-type local``) in ``--local-dir`` (e.g. ``/dev/shm``),
  with ``--async-save``; ``local_sync``: without it;
* ``memory``: the in-memory tier (``--zaya-memory-ckpt-interval``) in ``--local-dir``; ``memory_async``: with
  ``--async-save``. The local and in-memory tiers are copied to a pinned host pool and written by a thread of
  the training process (no device copy), with or without ``--async-save``: the loop waits for the copies at the
  next step's ``finalize_model_grads``, which the loop's excess time per save shows, not the save call;
* ``memory_restore``: the ``memory`` run SIGKILLed once its second in-memory save is written (so it makes no
  persistent save), then launched twice again: its save calls, the load from the in-memory tier (Megatron's
  ``load-checkpoint`` timer, and from launch to the first resumed step), and the resumed losses against the
  killed run's (the first resumed step exactly; later ones against the two resumes' own difference);
* ``part_restore``: the in-memory tier's restore alone, on any machine (CPU or GPU): a part of ``--part-gib``
  GiB of tensors (on the GPU if there is one) saved by the tier into ``--local-dir``, then found, checked and
  loaded back (``LocalTier.find_latest`` and ``load``, the tensors on their device) by a fresh process, ``--repeats``
  times, alternating with the package in ``--baseline`` (another version's ``megatron_zaya``, e.g. from ``git
  archive REV megatron_zaya | tar -x -C DIR``) when given: the seconds of each and this tree's over the baseline's.

Per mode it prints, from Megatron's log: the save call (Megatron's ``save-checkpoint`` timer: what the loop
waits for in the call), the loop's excess time per save (every iteration from the first save on, against the
``none`` run's median iteration: includes a background write's slowdown of the steps and its finalization),
the total time of a save (from "saving checkpoint" to the line saying it is complete: for a background save,
when the next step finalized it; for the local and in-memory tiers, when their thread has every rank's part
written, and copied to another node), the bytes per parameter of one checkpoint (its files over the parameters the
memory planner counts), for the background writer its peak device memory (``nvidia-smi``, the processes of
the run other than the trainer), and the trainer's peak device memory above the ``none`` run's (what the saves
add). The table is printed again after each mode. Persistent checkpoints beyond the newest are deleted as the
run goes (``--save-retain-interval``) and the local tiers keep one, so a mode holds two checkpoints at most (the
newest and the one being written); they are deleted once the mode is summarized.
At 10.98 bytes per parameter (measured on an H200), two of the 8-layer model's (2.2B parameters) fit a 64 GiB
disk, and two of the 12-layer model's (3.0B) 128 GiB of host memory (``/dev/shm``).

A background write of the 8-layer model takes 3.3-5.1 s with 8 writer threads on one H100
(``--dist-ckpt-workers 8``), 12-14 s with one (its log's ``[zaya] background save written`` lines); an interval
shorter than that measures the wait for the previous write. One H200 (the ``none`` run is each call's baseline;
about 2.5 minutes per mode at 60 iterations)::

    python -m benchmarks.checkpoint_save --modes none,async,local --iters 60 --interval 25 \\
        --extra "--dist-ckpt-workers 8" --dir /dev/shm/ckpt-bench --local-dir /dev/shm/ckpt-local
    python -m benchmarks.checkpoint_save --modes none,async --iters 300 --interval 130 --dir /dev/shm/ckpt-bench
    python -m benchmarks.checkpoint_save --num-layers 12 --modes async,local,sync --iters 20 --interval 20 \\
        --extra "--dist-ckpt-workers 8" --dir /dev/shm/ckpt-bench --local-dir /dev/shm/ckpt-local

The last one saves once per mode, at the last step (``--iters`` equal to ``--interval``: Megatron then makes no
extra save after it): 4 minutes for ``async`` and 5 for ``local`` on one H200 (``sync``: not measured yet).

The in-memory tier against today's ``--async-save``, in one call::

    python -m benchmarks.checkpoint_save --modes none,async,memory,memory_async --iters 60 --interval 25 \\
        --extra "--dist-ckpt-workers 8" --dir /dev/shm/ckpt-bench --local-dir /dev/shm/ckpt-mem
    python -m benchmarks.checkpoint_save --modes memory_restore --iters 80 --interval 25 \\
        --dir /dev/shm/ckpt-bench --local-dir /dev/shm/ckpt-mem

The restore of a 3 GiB part against another version (median of 3, a fresh process each)::

    python -m benchmarks.checkpoint_save --modes part_restore --part-gib 3 --repeats 3 --baseline /tmp/base \\
        --local-dir /dev/shm/ckpt-part

``--smoke`` runs the ``test`` preset on any device (CPU: fp32, gloo) to check the script. ``--sample-saves``
prints, per save call, what the trainer's main thread and the save's threads ran, sampled every 2 ms
(``benchmarks/save_sampler``; the sampling slows the process a little).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.megatron_log import iterations

SAMPLER = Path(__file__).parent / "save_sampler"  # its sitecustomize samples the save calls (--sample-saves)

MODES = {
    "none": [],
    "sync": ["--save-interval", "{interval}"],
    "async": ["--save-interval", "{interval}", "--async-save"],
    "local": ["--save-interval", "1000000", "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir",
              "{local}", "--non-persistent-save-interval", "{interval}", "--zaya-local-ckpt-keep", "1", "--async-save"],
    "local_sync": ["--save-interval", "1000000", "--non-persistent-ckpt-type", "local",
                   "--non-persistent-local-ckpt-dir", "{local}", "--non-persistent-save-interval", "{interval}",
                   "--zaya-local-ckpt-keep", "1"],
    "memory": ["--save-interval", "1000000", "--zaya-memory-ckpt-interval", "{interval}", "--zaya-memory-ckpt-keep",
               "1", "--zaya-memory-ckpt-dir", "{local}"],
    "memory_restore": ["--save-interval", "1000000", "--zaya-memory-ckpt-interval", "{interval}",
                       "--zaya-memory-ckpt-keep", "1", "--zaya-memory-ckpt-dir", "{local}"],
    "memory_async": ["--save-interval", "1000000", "--zaya-memory-ckpt-interval", "{interval}",
                     "--zaya-memory-ckpt-keep", "1", "--zaya-memory-ckpt-dir", "{local}", "--async-save"],
}
STAMP = r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\]"
STARTED = re.compile(STAMP + r" saving checkpoint at iteration\s+(\d+) to (\S+)")
DONE = re.compile(STAMP + r" successfully saved (?:local )?checkpoint from iteration\s+(\d+)")
WRITTEN = re.compile(STAMP + r" \[zaya\] local checkpoint of iteration (\d+) complete")  # the tier's thread
LOAD = re.compile(r"^\s+load-checkpoint \.+: \(([0-9.]+), ([0-9.]+)\)", re.MULTILINE)
CALL = re.compile(r"^\s+save-checkpoint(?:-non-persistent)? \.+: \(([0-9.]+), ([0-9.]+)\)", re.MULTILINE)


def _time(stamp: str) -> float:
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f").timestamp()


def flags(args) -> list[str]:
    shape = ["--zaya-preset", "test"] if args.smoke else ["--zaya-preset", "zaya1-8b-shallow", "--bf16"]
    if args.num_layers:
        shape += ["--num-layers", str(args.num_layers)]
    return shape + ["--mock-data", "--optimizer", "zaya_muon", "--seq-length", str(args.seq),
                    "--max-position-embeddings", str(args.seq), "--micro-batch-size", "1", "--global-batch-size",
                    str(args.gbs), "--train-iters", str(args.iters), "--lr", "3e-4", "--min-lr", "3e-5",
                    "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-iters", "0"]


def command(mode: str, args) -> list[str]:
    extra = [f.format(interval=args.interval, local=args.local_dir) for f in MODES[mode]]
    # Megatron keeps the checkpoints at multiples of the retain interval and needs it a multiple of every save
    # interval: this one keeps none of those written here but the newest.
    retain = str(args.interval * 1_000_000)
    save = ["--save", str(Path(args.dir) / mode), "--save-retain-interval", retain] if mode != "none" else []
    return [sys.executable, "-m", "megatron_zaya.pretrain", *flags(args), *save, *extra, *shlex.split(args.extra)]


def _watch_device_memory(trainer: int, peak: dict, stop: threading.Event) -> None:
    """Peak device memory (MiB) of the trainer and of the run's other processes (the background writer)."""
    while not stop.wait(0.5):
        try:
            table = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,"
                                    "nounits"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return
        for line in table.strip().splitlines():
            pid, used = (int(x) for x in line.split(","))
            if pid == trainer:
                peak["trainer"] = max(peak.get("trainer", 0), used)
            elif _group(pid) == trainer:  # (n/a where nvidia-smi sees another PID namespace)
                peak["writer"] = max(peak.get("writer", 0), used)


def _group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _launch_until(cmd: list[str], log: Path, env: dict, done) -> float | None:
    """Run ``cmd`` into ``log`` until ``done(log text)``, then SIGKILL it with its helpers (as a crash); the seconds
    from launch to its first logged step."""
    with log.open("w") as out:
        started, first_step = time.time(), None
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            while proc.poll() is None and not done(text := log.read_text()):
                first_step = first_step or (time.time() - started if iterations(text) else None)
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print(f"{log.name}: steps {sorted(iterations(log.read_text()))} in {time.time() - started:.1f} s, the first "
          f"{first_step or float('nan'):.1f} s after launch", flush=True)  # (a call's time limit may end the rest)
    return first_step


def restore(args) -> None:
    """``memory_restore``: SIGKILL the ``memory`` run once its second in-memory save is written and three steps
    past it are logged, launch it twice more from what it left, and print how long the load from the in-memory
    tier took and how the resumed losses compare with the killed run's. The first resumed step depends only on the
    restored state and its batch, so it must repeat exactly; later steps may differ on a GPU by as much as the two
    resumes differ from each other (a GPU's attention backward need not be deterministic)."""
    shutil.rmtree(Path(args.dir) / "memory_restore", ignore_errors=True)
    shutil.rmtree(args.local_dir, ignore_errors=True)
    cmd, second = command("memory_restore", args), 2 * args.interval
    print("$ " + " ".join(cmd), flush=True)
    logs = [Path(args.dir) / f"memory_restore-{name}.log" for name in ("killed", "resumed", "resumed-again")]
    logs[0].parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}

    def written(text: str) -> bool:
        done = [int(i) for _, i in WRITTEN.findall(text)]
        return second in done and max(iterations(text), default=0) >= max(max(done) + 1, second + 3)

    _launch_until(cmd, logs[0], env, written)
    first_step = [_launch_until(cmd, log, env, lambda text: len(iterations(text)) >= 3) for log in logs[1:]]
    killed, *resumes = (iterations(log.read_text()) for log in logs)
    calls = [float(high) / 1000 for _, high in CALL.findall(logs[0].read_text())]
    load = [float(high) / 1000 for log in logs[1:] for _, high in LOAD.findall(log.read_text())]
    tier = all("resuming from the local checkpoint" in log.read_text() for log in logs[1:])
    steps = [i for i in sorted(resumes[0]) if i in killed and i in resumes[1]]
    for i in steps:
        print(f"  step {i}: lm loss killed {killed[i][1]:.6E}, resumed {resumes[0][i][1]:.6E}, resumed again "
              f"{resumes[1][i][1]:.6E}")
    gap = max((abs(r[i][1] - killed[i][1]) for r in resumes for i in steps[1:]), default=float("nan"))
    noise = max((abs(resumes[0][i][1] - resumes[1][i][1]) for i in steps[1:]), default=float("nan"))
    exact = all(r and min(r) in killed and r[min(r)][1] == killed[min(r)][1] for r in resumes)
    print(f"\nmemory_restore: the killed run's in-memory saves blocked {', '.join(f'{c:.2f}' for c in calls)} s; "
          f"resumed at step {min(resumes[0], default=None)} from {'the in-memory tier' if tier else 'NOT the tier'}; "
          f"load-checkpoint {', '.join(f'{x:.2f}' for x in load)} s; launch to the first resumed step "
          f"{', '.join(f'{x:.1f}' for x in first_step if x)} s; first resumed step's loss "
          f"{'equal to' if exact else 'DIFFERENT from'} the killed run's; later steps differ by at most {gap:.2E} "
          f"from the killed run and {noise:.2E} between the two resumes", flush=True)
    shutil.rmtree(Path(args.dir) / "memory_restore", ignore_errors=True)
    shutil.rmtree(args.local_dir, ignore_errors=True)


# A fresh process's resume from the tier in argv[1] (gloo store argv[2]): seconds to find and check, and to load,
# and the CPU seconds of the two (every thread's, user and system: steadier than the wall time on a shared machine).
RESTORE = """
import json, sys, time, torch
torch.distributed.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
from megatron.core import parallel_state
from megatron_zaya.checkpoint.local_tier import LocalTier
from megatron_zaya.patches import apply_patches
apply_patches("checkpointing.local_tier" if torch.cuda.is_available() else "cpu,checkpointing.local_tier")
parallel_state.initialize_model_parallel()
tier = LocalTier(sys.argv[1], 1, None)
start, cpu = time.perf_counter(), time.process_time()
latest = tier.find_latest()
found = time.perf_counter()
tensors = tier.load()[0].pop_tensors()
torch.cuda.synchronize() if torch.cuda.is_available() else None
print(json.dumps({"latest": latest, "find": found - start, "load": time.perf_counter() - found,
                  "cpu": time.process_time() - cpu, "devices": sorted({t.device.type for t in tensors})}))
"""


def save_part(directory: Path, gib: float) -> int:
    """Save, through the local tier (one gloo rank), a part of ``gib`` GiB of tensors shaped as a model's state
    (bf16 weights, their fp32 master weights and momentum, small vectors), on the GPU if there is one; its
    bytes."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    from megatron_zaya.checkpoint import staging
    from megatron_zaya.checkpoint.local_tier import LocalTier
    from megatron_zaya.patches import apply_patches

    device = "cuda" if torch.cuda.is_available() else "cpu"
    apply_patches("checkpointing.local_tier" if device == "cuda" else "cpu,checkpointing.local_tier")
    tensors, total = [], 0
    while total < gib * 2**30:  # a layer: a 64 MiB bf16 matrix, its fp32 master weight and momentum, a vector
        weight = torch.randn(4096, 8192, device=device, dtype=torch.bfloat16)
        tensors += [weight, weight.float(), weight.float().neg_(), torch.randn(4096, device=device)]
        total += sum(t.nbytes for t in tensors[-4:])
    with tempfile.TemporaryDirectory() as store:
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
        state = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", t, (0, 0, 1)) for i, t in enumerate(tensors)}
        state, _ = MCoreTensorAwareStateDict.from_state_dict(state, algo="fully_parallel")
        tier = LocalTier(str(directory), 1, None)
        tier.save(state, 1, is_async=False)
        staging.wait_for_copies()
        tier.finish()
        staging._pools.clear()  # the host pool's memory back for the restores
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    return total


def part_restore(args) -> None:
    """``part_restore``: a part saved once, then restored by a fresh process ``--repeats`` times per package
    (this tree's, ``--baseline``'s), alternating; prints each restore and the medians."""
    directory = Path(args.local_dir)
    shutil.rmtree(directory, ignore_errors=True)
    size = save_part(directory, args.part_gib)
    trees = {"this tree": Path(__file__).resolve().parent.parent}
    if args.baseline:
        trees["baseline"] = Path(args.baseline).resolve()
    seconds: dict[str, list[float]] = {name: [] for name in trees}
    cpu: dict[str, list[float]] = {name: [] for name in trees}
    for repeat in range(args.repeats):
        for name, tree in trees.items():
            with tempfile.TemporaryDirectory() as scratch:  # the working directory: not first on the path
                done = subprocess.run([sys.executable, "-c", RESTORE, str(directory), f"{scratch}/store"], cwd=scratch,
                                      env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"part_restore with {name}: exited {done.returncode}\n{done.stderr[-3000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            seconds[name].append(result["find"] + result["load"])
            cpu[name].append(result["cpu"])
            phases = [line for line in done.stdout.splitlines() if "found and read in" in line]
            print(f"{name}, restore {repeat + 1}: iteration {result['latest']} onto {', '.join(result['devices'])}: "
                  f"found and checked {result['find']:.2f} s, loaded {result['load']:.2f} s, CPU time "
                  f"{result['cpu']:.2f} s" + (f"\n  {phases[0]}" if phases else ""), flush=True)
    wall = {name: statistics.median(values) for name, values in seconds.items()}
    busy = {name: statistics.median(values) for name, values in cpu.items()}
    print(f"\npart_restore: {size / 2**30:.2f} GiB, median of {args.repeats}: " + ", ".join(
        f"{name} {wall[name]:.2f} s ({size / 2**30 / wall[name]:.2f} GiB/s), CPU time {busy[name]:.2f} s"
        for name in trees) + (f"; this tree / baseline {wall['this tree'] / wall['baseline']:.2f}, CPU time "
                              f"{busy['this tree'] / busy['baseline']:.2f}" if args.baseline else ""), flush=True)
    shutil.rmtree(directory, ignore_errors=True)


def run(mode: str, args) -> dict:
    shutil.rmtree(Path(args.dir) / mode, ignore_errors=True)
    shutil.rmtree(args.local_dir, ignore_errors=True)
    cmd = command(mode, args)
    print("$ " + " ".join(cmd), flush=True)
    log = Path(args.dir) / f"{mode}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    peak, stop = {}, threading.Event()
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    samples = Path(args.dir).resolve() / f"{mode}-save-samples"
    if args.sample_saves:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SAMPLER), env.get("PYTHONPATH")]))
        env["ZAYA_SAVE_SAMPLES"] = str(samples)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        watcher = threading.Thread(target=_watch_device_memory, args=(proc.pid, peak, stop), daemon=True)
        watcher.start()
        try:
            code = proc.wait()
        finally:
            stop.set()
            if proc.poll() is None:  # this benchmark stopped (SIGTERM, Ctrl-C): the run and its helpers too
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for path in sorted(samples.parent.glob(f"{samples.name}.*.txt")) if args.sample_saves else ():
        print(f"{mode}: the save calls sampled ({path.name}):\n{path.read_text()}", flush=True)
        path.unlink()
    text = log.read_text()
    if code:
        sys.stderr.write(text[-5000:])
        raise SystemExit(f"{mode}: zaya-pretrain exited {code} (log: {log})")
    result = dict(summarize(text, args.interval), writer_mib=peak.get("writer"), trainer_mib=peak.get("trainer"))
    shutil.rmtree(Path(args.dir) / mode, ignore_errors=True)  # the next mode gets the storage to itself
    shutil.rmtree(args.local_dir, ignore_errors=True)
    return result


def summarize(text: str, interval: int) -> dict:
    """What a run's log says about the saves of its tier at the save interval (not the extra save that Megatron
    makes after a last step off the interval: ``--iters`` equal to ``--interval`` measures one save without it)."""
    starts = [(int(i), _time(t), where) for t, i, where in STARTED.findall(text)]
    tier = starts[0][2] if starts else None  # (the save after the last step of a local run goes to --save)
    started = {i: t for i, t, where in starts if where == tier and i % interval == 0}
    # A local tier's save is complete when its thread says so (Megatron's line comes as the save starts)
    done = {int(i): _time(t) for t, i in DONE.findall(text) + WRITTEN.findall(text)}
    kept = [Path(tier) / f"iter_{i:07d}" for i, _, where in reversed(starts)
            if where == tier and (Path(tier) / f"iter_{i:07d}").is_dir()]  # older ones are deleted as it goes
    return {"iterations": iterations(text), "calls_ms": [float(high) for _, high in CALL.findall(text)][:len(started)],
            "totals_s": [done[i] - t for i, t in sorted(started.items()) if i in done], "saved": sorted(started),
            "bytes": sum(f.stat().st_size for f in kept[0].rglob("*") if f.is_file()) if kept else None}


def parameters(args) -> float:
    """The model's parameters, as the memory planner counts them (one rank holds all of them here)."""
    from megatron_zaya.config import zaya_config
    from megatron_zaya.memory_plan import Parallel, parameter_counts

    shape = {"num_layers": args.num_layers} if args.num_layers else {}
    cfg = zaya_config("test" if args.smoke else "zaya1-8b-shallow", **shape)
    return sum(parameter_counts(cfg, Parallel()).values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="none,sync,async,local",
                        help=f"comma-separated: {', '.join(MODES)}, part_restore")
    parser.add_argument("--num-layers", type=int, default=None, help="layers (default: the preset's 8)")
    parser.add_argument("--dir", default="runs/checkpoint-save", help="persistent checkpoints and logs")
    parser.add_argument("--local-dir", default="/dev/shm/zaya-checkpoint-save", help="the local tier's directory")
    parser.add_argument("--interval", type=int, default=5, help="steps between saves")
    parser.add_argument("--iters", type=int, default=16, help="training steps per mode")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--gbs", type=int, default=2, help="global batch (micro-batch 1)")
    parser.add_argument("--extra", default="", help="flags added to every mode's command, e.g. '--dist-ckpt-workers 4'")
    parser.add_argument("--smoke", action="store_true", help="the test preset, anywhere (checks the script)")
    parser.add_argument("--sample-saves", action="store_true",
                        help="print what the trainer's threads run during each save call, sampled every 2 ms")
    parser.add_argument("--part-gib", type=float, default=3.0, help="part_restore: GiB of tensors in the part")
    parser.add_argument("--repeats", type=int, default=3, help="part_restore: restores per package")
    parser.add_argument("--baseline", help="part_restore: a directory holding another version's megatron_zaya")
    args = parser.parse_args(argv)
    # SIGTERM (a time limit's) unwinds like Ctrl-C, so that the runs, each in a session of its own, end with it
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.smoke:
        args.seq, args.iters, args.interval = 64, 16, 4  # the resumed runs' 3 steps make no save
    count = parameters(args)
    results = {}
    for mode in args.modes.split(","):
        if mode in ("memory_restore", "part_restore"):
            (restore if mode == "memory_restore" else part_restore)(args)
            continue
        results[mode] = run(mode, args)
        print(table(results, count), flush=True)  # the modes so far (a call's time limit may end the rest)
    return 0


def table(results: dict, count: float) -> str:
    base = results.get("none")
    baseline = statistics.median(ms for i, (ms, _) in base["iterations"].items() if i > 2) if base else None
    lines = [f"\n{'mode':<12} {'saves':>5} {'save call ms':>13} {'loop excess ms/save':>20} {'total s/save':>13} "
             f"{'bytes/param':>12} {'writer MiB':>11} {'trainer +MiB':>13}   ({count / 1e6:.1f}M parameters, baseline "
             f"{baseline or float('nan'):.0f} ms/iteration)"]
    for mode, r in results.items():
        saves = len(r["saved"])
        excess = float("nan")
        if baseline and saves:
            after = [ms for i, (ms, _) in r["iterations"].items() if i > min(r["saved"])]
            excess = (sum(after) - baseline * len(after)) / saves
        call = statistics.mean(r["calls_ms"]) if r["calls_ms"] else float("nan")
        total = statistics.mean(r["totals_s"]) if r["totals_s"] else float("nan")
        per_param = r.get("bytes") / count if r.get("bytes") else float("nan")
        writer = r.get("writer_mib") if r.get("writer_mib") is not None else "n/a"
        extra = "n/a" if None in (r.get("trainer_mib"), (base or {}).get("trainer_mib")) else \
            r["trainer_mib"] - base["trainer_mib"]
        lines.append(f"{mode:<12} {saves:>5} {call:>13.0f} {excess:>20.0f} {total:>13.2f} {per_param:>12.2f} "
                     f"{writer:>11} {extra:>13}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
