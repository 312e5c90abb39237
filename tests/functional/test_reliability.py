"""Faults injected into real zaya-pretrain runs (docs/reliability.md has the fault matrix).

Faults come from the test-side hooks of tests/fault_hooks (zaya_cli.with_faults), from signals sent to the
trainer (tests/kill_before_tracker.py times one), and from damaged files on disk.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from zaya_cli import (KILLED_RUN, QUICK, assert_resumed_exactly, checkpoint_state, differing, loss_csv, losses,
                      pretrain, same_leaf, with_faults)

from megatron_zaya.training.ledger import KILLED

SKIPPED = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?number of skipped iterations:\s+(\d+)")


def _last_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("zaya-pretrain: error:")]
    assert lines, stderr[-3000:]
    return lines[-1]


def test_nonfinite_steps_are_skipped_spikes_logged_and_a_streak_stops_the_run(tmp_path):
    ckpt = tmp_path / "ckpt"
    faults = "nan_loss@3,inf_grad@4,loss_spike@7,nan_grad@9,inf_loss@10,nan_loss@11"
    run = pretrain(QUICK + ["--train-iters", "20", "--save-interval", "2", "--save", str(ckpt), "--load", str(ckpt),
                            "--zaya-max-nonfinite-steps", "3", "--zaya-loss-spike-window", "8"],
                   cwd=tmp_path, extra_env=with_faults(faults))
    assert run.returncode == 3, run.stderr[-3000:]
    error = _last_error(run.stderr)
    assert "3 steps in a row (iterations 9-11)" in error and "--iterations-to-skip 9 10 11" in error, error
    assert error.endswith(f"last checkpoint: {ckpt}/iter_0000010 (iteration 10)"), error

    skipped = {int(i): int(n) for i, n in SKIPPED.findall(run.stdout)}
    assert sorted(skipped) == list(range(1, 11))  # step 11 stopped the run before its log line
    assert [i for i, n in skipped.items() if n] == [3, 4, 9, 10]

    spikes = re.findall(r"iteration\s+(\d+) \| loss spike", run.stdout)
    assert spikes == ["7"], spikes
    assert losses(run.stdout)[7] > 5 * losses(run.stdout)[6]

    # Steps 3 and 4 were skipped on every count: the checkpoint after them equals the one before them bit for
    # bit (weights, Adam moments and step count, LR schedule, balancing biases and their moments, RNG states)
    # but for the iteration counters; steps 5 and 6 trained.
    before, after = checkpoint_state(ckpt / "iter_0000002", tmp_path), checkpoint_state(ckpt / "iter_0000004", tmp_path)
    counters = [k for k in before if k.endswith(("/iteration", "/num_floating_point_operations_so_far",
                                                 "/rerun_state_machine/current_iteration"))]
    assert len(counters) == 3 and all(after[k] > before[k] for k in counters), counters
    assert differing(before, after) == sorted(counters)
    steps = [k for k in before if k.endswith(("/opt_param_scheduler/num_steps", "/common_step"))]
    assert {k.rsplit("/", 1)[1] for k in steps} == {"num_steps", "common_step"}  # the dense and expert Adams
    assert any("balancing_biases" in k for k in before) and any("rng_state" in k for k in before)
    later = checkpoint_state(ckpt / "iter_0000006", tmp_path)
    assert all(later[k] > after[k] for k in steps), [(later[k], after[k]) for k in steps]
    assert not same_leaf(later["decoder.final_layernorm.weight"], after["decoder.final_layernorm.weight"])


def test_a_hang_while_setting_up_is_declared_and_the_run_exits(tmp_path):
    """A hang after the watchdog starts (with the optimizer) and before the first iteration: the building of the data
    iterators never returns. The watchdog declares it after its first-step allowance (10 x 1 s) and exits 4; the
    ledger records it. (Its thread ended on reading the iteration, which the training loop had not set yet, and the
    run stayed hung.)"""
    save = tmp_path / "ck"
    run = pretrain(QUICK + ["--train-iters", "4", "--save", str(save), "--save-interval", "2",
                            "--zaya-watchdog-seconds", "1"], cwd=tmp_path, extra_env=with_faults("setup_hang@0"),
                   timeout=180)
    assert run.returncode == 4, run.stderr[-3000:]
    line = _last_error(run.stderr)
    assert " while setting up, before its first step (data loaders) (allowed: 10 s" in line, line
    events = [json.loads(line) for line in (save / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["step"]) for e in events if e["event"] == "hang"] == [("hang", 1)], events


def test_a_checkpoint_load_longer_than_the_watchdogs_allowance_is_no_hang(tmp_path):
    """The watchdog starts with the optimizer, before Megatron loads the checkpoint into it: a load of 25 s under
    ``--zaya-watchdog-seconds 2`` (20 s before the first step) is no hang, as a save is none (patch
    ``reliability.watchdog_loads``), and the resumed run trains on."""
    flags = QUICK + ["--train-iters", "4", "--save-interval", "2", "--save", "ck", "--zaya-watchdog-seconds", "2"]
    first = pretrain(flags + ["--exit-interval", "2"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = pretrain(flags, cwd=tmp_path, extra_env=with_faults("slow_load@0"), timeout=300)
    assert resumed.returncode == 0 and "made no progress" not in resumed.stderr, resumed.stderr[-3000:]
    assert sorted(losses(resumed.stdout)) == [3, 4]


def test_replica_drift_and_a_nan_on_one_rank_under_torchrun(tmp_path):
    """Two data-parallel ranks (gloo): a NaN gradient on rank 1 only makes both skip (the replicas still
    match at the next check); a weight changed on rank 1 stops both at the next check, naming rank and tensor."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **with_faults("nan_grad@3@1,drift@5@1")}
    env.pop("WORLD_SIZE", None)
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
         "megatron_zaya.pretrain", *QUICK, "--micro-batch-size", "2", "--train-iters", "8",
         "--zaya-replica-check-interval", "2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    # Each rank stops with exit code 3 (a fault); torchrun exits 1 and reports its workers' exit codes. The first
    # rank to exit is the root cause; a rank still shutting down by then gets torchrun's SIGTERM (-15).
    codes = dict(re.findall(r"rank\s*: (\d+) \(local_rank.*?exitcode\s*: (-?\d+)", out, re.S))
    root_cause = re.search(r"Root Cause.*?exitcode\s*: (-?\d+)", out, re.S)
    assert run.returncode == 1 and root_cause and root_cause.group(1) == "3", out[-3000:]
    assert set(codes.values()) <= {"3", "-15"}, out[-3000:]
    assert re.findall(r"iteration\s+(\d+) \| data-parallel replicas identical", out) == ["2", "4"], out[-3000:]
    assert re.search(r"iteration\s+3 \| non-finite step skipped .*ranks with a non-finite grad norm: 1", out)
    errors = re.findall(r"zaya-pretrain: error: data-parallel replicas hold different weights at iteration 6 "
                        r"\(rank 1 differs from rank 0 in embedding.word_embeddings.weight\)", out)
    assert len(errors) >= max(1, list(codes.values()).count("3")), out[-3000:]  # every rank that exited on its own named it


def test_a_step_failing_in_every_launch_stops_the_run_or_is_skipped(tmp_path):
    """Step 1 raises in every launch (``crash@1``) under zaya-torchrun --max-restarts 3 with --zaya-max-step-failures
    2: two launches fail at step 1, the third stops before training with one line naming the step, the rank and the
    error, exit 5, and the launcher leaves its last restart unused. --zaya-skip-failing-steps then skips step 1's
    batch (Megatron consumes it: 8 skipped samples) and trains on; the ledger records it. That launch's node fails
    its self-test, which --zaya-no-self-test leaves out.

    The looping job was started with --zaya-overwrite-save over an old run's ledger: its first launch deletes that,
    and its restarts keep what the job itself recorded (they used to delete it too, and the guard never fired)."""
    flags = QUICK + ["--train-iters", "3", "--save-interval", "3", "--save", "ck", "--zaya-max-step-failures", "2"]
    ledger = tmp_path / "ck" / "events.jsonl"
    ledger.parent.mkdir()
    ledger.write_text(json.dumps({"time": "2026-01-01T00:00:00+00:00", "event": "crash", "step": 1, "rank": 0,
                                  "node": "old", "launch": "old", "cause": "RuntimeError: an old run's"}) + "\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **with_faults("crash@1")}
    env.pop("WORLD_SIZE", None)
    run = subprocess.run([sys.executable, "-m", "megatron_zaya.launch", "--standalone", "--nproc-per-node", "1",
                          "--max-restarts", "3", "-m", "megatron_zaya.pretrain", *flags, "--zaya-overwrite-save"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 5, run.stderr[-3000:]
    assert run.stdout.count("[zaya] relaunch 1 of this job: --zaya-overwrite-save deleted the old checkpoints at its "
                            "first launch only; resuming from --save") == 1, run.stdout[-3000:]
    events = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert [(e["event"], e["step"]) for e in events] == [("start", 1), ("crash", 1), ("restart", 1), ("crash", 1)]
    error = _last_error(run.stderr)
    assert error == (f"zaya-pretrain: error: step 1 failed in 2 launches in a row (--zaya-max-step-failures 2), last "
                     f"on rank 0 ({events[-1]['node']}): RuntimeError: injected fault (ZAYA_FAULT_INJECT); stopping "
                     "instead of restarting (exit 5). Fix the cause and relaunch with a higher "
                     "--zaya-max-step-failures, or skip the step's batch with --zaya-skip-failing-steps "
                     "(ck/events.jsonl)"), error
    assert run.stderr.count("zaya-pretrain: error: step 1 failed") == 1
    assert "zaya-torchrun: a worker stopped on a crash loop; not restarted: exit 5" in run.stderr

    # The node's self-test is broken too (bad_gemm): --zaya-no-self-test trains without it.
    skipping = pretrain(flags + ["--zaya-skip-failing-steps", "--zaya-no-self-test"], cwd=tmp_path,
                        extra_env=with_faults("crash@1,bad_gemm@0"))
    assert skipping.returncode == 0, skipping.stderr[-3000:]
    consumed = re.findall(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \| skipped samples:\s+(\d+)",
                          skipping.stdout)
    assert consumed == [("2", "16", "8"), ("3", "24", "8")], consumed
    events = [json.loads(line) for line in ledger.read_text().splitlines()][4:]
    assert [(e["event"], e["step"], e["steps_lost"]) for e in events] == [
        ("skipped_step", 1, 1), ("restart", 2, 0), ("end", 3, 0)], events


KILL_BEFORE_TRACKER = str(Path(__file__).parents[1] / "kill_before_tracker.py")


def _launch(flags, cwd, log, extra_env=None, launcher=("-m", "megatron_zaya.pretrain")):
    """zaya-pretrain in its own process group (as a scheduler's job step), output to ``log``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    env.pop("WORLD_SIZE", None)
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, *launcher, *flags], cwd=cwd, stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _end_job_step(proc):
    """What Slurm does after the main process dies: kill what is left of the group (a SIGKILLed trainer
    leaves the checkpoint writer's spawned helper behind)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_sigkill_during_a_save_then_sigterm_with_a_deadline(tmp_path, uninterrupted):
    """SIGKILL after the data of checkpoint 6 is written but before `latest` is replaced: the next launch
    resumes from 3 with the same losses; SIGTERM then saves and exits 0 within --zaya-sigterm-deadline."""
    ckpt = tmp_path / "ckpt"
    flags = KILLED_RUN + ["--save-interval", "3", "--save", str(ckpt), "--load", str(ckpt)]
    killed = _launch(flags, tmp_path, tmp_path / "killed.log", launcher=(KILL_BEFORE_TRACKER, "6"))
    code = killed.wait(timeout=600)
    _end_job_step(killed)
    assert code == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-3000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert (ckpt / "iter_0000006").is_dir()  # written, never marked as the latest
    first = losses((tmp_path / "killed.log").read_text())

    deadline = 120
    log = tmp_path / "resumed.log"
    proc = _launch(flags + ["--zaya-sigterm-deadline", str(deadline)], tmp_path, log)
    start = time.time()
    while time.time() - start < 300 and 8 not in losses(log.read_text()) and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    signalled = time.time()
    code = proc.wait(timeout=deadline + 60)
    took = time.time() - signalled
    _end_job_step(proc)
    assert code == 0 and took < deadline, (code, took, log.read_text()[-3000:])
    resumed = losses(log.read_text())
    assert min(resumed) == 4
    assert f"[zaya] took over the lock of --save {ckpt} from a run that ended without releasing it (host " in \
        log.read_text() and f", PID {killed.pid}, " in log.read_text()
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert saved == max(resumed) >= 8
    assert_resumed_exactly(loss_csv(ckpt / "loss.csv"), range(1, 9), first, resumed, uninterrupted)  # from checkpoint 3
    # The killed launch wrote nothing more after its start; the next one tells that from a clean end.
    events = [json.loads(line) for line in (ckpt / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["step"]) for e in events] == [("start", 1), ("restart", 4), ("end", saved)], events
    assert events[1]["cause"] == KILLED and events[1]["steps_lost"] is None, events[1]


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.3], ids=["at-start", "early", "late"])
def test_sigkill_at_a_moment_of_a_save_leaves_latest_naming_a_complete_checkpoint(delay, tmp_path, uninterrupted):
    """The whole job step SIGKILLed ``delay`` s after the directory of checkpoint 6 appears (from outside, as a
    node failure would): whatever was on disk by then, ``latest`` names a complete checkpoint, and the next
    launch resumes from it with the losses of the killed run.

    The job step is stopped (SIGSTOP) first, so that what is on disk is what the kill leaves. ``at-start`` must
    stop it mid-save, before the checkpoint's metadata is written; on a busy machine this process may first see
    the directory after that, so it launches again, up to three times."""
    for attempt in range(3 if delay == 0.0 else 1):
        run_dir = tmp_path / f"launch{attempt}"
        run_dir.mkdir()
        ckpt = run_dir / "ckpt"
        flags = KILLED_RUN + ["--save-interval", "3", "--save", str(ckpt), "--load", str(ckpt)]
        proc = _launch(flags, run_dir, run_dir / "killed.log")
        target, deadline = ckpt / "iter_0000006", time.time() + 300
        while not target.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.001)
        time.sleep(delay)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGSTOP)
        mid_save = not (target / "metadata.json").exists()
        _end_job_step(proc)
        proc.wait(timeout=60)
        if mid_save:
            break
    first = losses((run_dir / "killed.log").read_text())

    latest = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert latest in (3, 6)
    if delay == 0.0:
        assert latest == 3 and mid_save  # killed mid-save: the case under test
    complete = ckpt / f"iter_{latest:07d}"
    assert (complete / ".metadata").is_file() and (complete / "metadata.json").is_file()

    resumed = pretrain(flags + ["--exit-interval", str(latest + 3)], cwd=run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = losses(resumed.stdout)
    assert min(after) == latest + 1
    assert_resumed_exactly(loss_csv(ckpt / "loss.csv"), range(1, latest + 4), first, after, uninterrupted)


def test_a_kill_as_a_save_returns_leaves_the_curve_of_its_steps(tmp_path, uninterrupted):
    """SIGKILL at the moment the save of checkpoint 6 has named it in the tracker file (a test-side hook): the
    loss curve beside it already holds steps 4-6, and the next launch resumes from 6 with the curve of every step."""
    ckpt = tmp_path / "ckpt"
    flags = KILLED_RUN + ["--save-interval", "3", "--save", str(ckpt), "--load", str(ckpt)]
    killed = pretrain(flags, cwd=tmp_path, extra_env=with_faults("kill_after_save@6"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "6"
    first = losses(killed.stdout)
    assert sorted(loss_csv(ckpt / "loss.csv")) == list(range(1, 7)) and max(first) == 6

    resumed = pretrain(flags + ["--exit-interval", "8"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = losses(resumed.stdout)
    assert min(after) == 7
    assert_resumed_exactly(loss_csv(ckpt / "loss.csv"), range(1, 9), first, after, uninterrupted)


def _processes_of_group(pgid: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def test_a_save_failing_mid_training_is_reported_and_the_previous_checkpoint_kept(tmp_path, uninterrupted):
    """The disk fills up between two saves: RLIMIT_FSIZE, half the largest file of checkpoint 3, is set on the
    trainer and its checkpoint writers once checkpoint 3 is complete, so saving 6 fails with EFBIG (a real
    failed write, as on a full disk). One line names the failure and the intact checkpoint, exit 3, `latest`
    stays 3, and the next launch resumes from 3 with the same losses."""
    ckpt = tmp_path / "ckpt"
    flags = KILLED_RUN + ["--save-interval", "3", "--save", str(ckpt), "--load", str(ckpt)]
    log = tmp_path / "full.log"
    proc = _launch(flags, tmp_path, log)
    latest, deadline = ckpt / "latest_checkpointed_iteration.txt", time.time() + 300
    while not (latest.is_file() and latest.read_text() == "3") and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    largest = max(f.stat().st_size for f in (ckpt / "iter_0000003").rglob("*") if f.is_file())
    for pid in _processes_of_group(proc.pid):
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (largest // 2, largest // 2))
    code = proc.wait(timeout=300)
    time.sleep(1)  # the kernel's signal to the helpers takes a moment
    left = _processes_of_group(proc.pid)  # data-loader workers ignore SIGTERM: runtime.end_data_workers_at_exit
    _end_job_step(proc)
    output = log.read_text()
    assert code == 3 and left == [], (left, output[-3000:])
    error = _last_error(output)
    assert "saving the checkpoint of iteration 6" in error and "failed" in error, error
    assert "iter_0000003 (iteration 3)" in error and "its partial iter_0000006 is removed" in error, error
    assert latest.read_text() == "3" and not (ckpt / "iter_0000006").exists()
    first = losses(output)
    assert max(first) == 6

    resumed = pretrain(flags + ["--exit-interval", "6"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = losses(resumed.stdout)
    assert min(after) == 4
    assert_resumed_exactly(loss_csv(ckpt / "loss.csv"), range(1, 7), first, after, uninterrupted)


def test_a_full_disk_is_named_and_the_partial_save_removed(tmp_path):
    """The disk fills up while checkpoint 4 is written: --save on a 45 MB tmpfs, where checkpoint 2 (30 MB) fits
    and 4 does not. One line says the disk is full, the partial directory that filled it is gone, and `latest`
    still names checkpoint 2."""
    ckpt = tmp_path / "disk"
    ckpt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=45m", "tmpfs", str(ckpt)], check=True)  # needs root
    try:
        run = pretrain(QUICK + ["--train-iters", "4", "--save-interval", "2", "--save", str(ckpt)], cwd=tmp_path)
        assert run.returncode == 3, run.stderr[-3000:]
        error = _last_error(run.stderr)
        assert error.startswith("zaya-pretrain: error: saving the checkpoint of iteration 4 to "
                                f"{ckpt} failed (the disk is full, ENOSPC: No space left on device; its partial "
                                "iter_0000004 is removed); free space"), error
        assert error.endswith(f"{ckpt}/iter_0000002 (iteration 2)"), error
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
        assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000002"]
    finally:
        subprocess.run(["umount", str(ckpt)], check=True)


def test_truncated_data_stops_in_one_line(tmp_path):
    from megatron_zaya.data import embedded_tokenizer_dir
    from megatron_zaya.data.preprocess import embedded_dataset_prefix

    prefix = embedded_dataset_prefix(str(tmp_path / "data"))
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(prefix + ".bin") // 2)
    run = pretrain(QUICK + ["--train-iters", "3", "--data-path", prefix, "--tokenizer-type", "HuggingFaceTokenizer",
                            "--tokenizer-model", embedded_tokenizer_dir(), "--save", str(tmp_path / "ckpt")],
                   cwd=tmp_path)
    assert run.returncode == 2, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"zaya-pretrain: error: {prefix}.bin has ") and "truncated" in last, last
    assert last.endswith("rebuild it with zaya-preprocess (or copy it again)"), last
    assert not (tmp_path / "ckpt").exists()
