"""Faults of a run on two gloo ranks under zaya-torchrun, each followed by a restart from the newest checkpoint, and
the event ledger that names them.

A first launch finds rank 1's node unhealthy (its self-test's GEMM returns a wrong element): exit 6, no restart.
The relaunch (as Slurm's requeue without the node) then meets, under ``--max-restarts 3``: an exception on rank 1
at step 5; rank 1 stopped with SIGSTOP after step 7, which rank 0's progress watchdog (``--zaya-watchdog-seconds``)
declares a hang (exit 4); rank 1 killed with SIGKILL after the next launch's step 7, and the newest checkpoint (6)
damaged while the run is down (torchrun's agent stopped until both ranks are gone). The last restart resumes past it
from 3 and reaches step 9 with an uninterrupted run's losses. (A SIGKILL without a launcher, and a crash loop: test_reliability.py.)"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import psutil
import pytest
from zaya_cli import KILLED_RUN, loss_csv, losses, with_faults

T = 3
FLAGS = KILLED_RUN + ["--save-interval", "3", "--exit-interval", "9", "--zaya-watchdog-seconds", str(T), "--save", "ck"]
HANG = re.compile(r"zaya-pretrain: error: rank 0 made no progress for \d+ s in iteration (\d+) \(allowed: (\d+) s")


def _zaya_torchrun(restarts: int, cwd, log, faults: str):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **with_faults(faults)}
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, "-m", "megatron_zaya.launch", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", str(restarts), "-m", "megatron_zaya.pretrain", *FLAGS]
    with log.open("w") as out:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _seconds(event: dict) -> float:
    return datetime.fromisoformat(event["time"]).timestamp()


def _rank_1(launcher: psutil.Process, restart: int) -> psutil.Process | None:
    for process in launcher.children(recursive=True):
        try:
            env = process.environ()
        except psutil.Error:
            continue
        if env.get("RANK") == "1" and env.get("TORCHELASTIC_RESTART_COUNT") == str(restart):
            return process
    return None


def _signal_rank_1_after(launcher, log, restart: int, step: int, signum, before=lambda: None) -> psutil.Process:
    """Once ``restart``'s rank 1 has logged ``step``, call ``before()`` and send it ``signum``."""
    deadline = time.time() + 300
    while (rank := _rank_1(psutil.Process(launcher.pid), restart)) is None:
        assert launcher.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    start = len(log.read_text())
    while step not in losses(log.read_text()[start:]):
        assert launcher.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    before()
    rank.send_signal(signum)
    return rank


def _waits_for_a_stopped_peer(entry: dict) -> bool:
    """A flight-recorder entry of a collective that a rank stopped in the training loop never joined: the gradients'
    data-parallel all-reduce, or the end of the step's all-gather of the ranks' signals."""
    frames = [frame["name"] for frame in entry["frames"]]
    gradient_sync = (entry["process_group"][1] in ("DATA_PARALLEL_GROUP_WITH_CP", "EXPERT_DATA_PARALLEL_GROUP")
                     and entry["profiling_name"] == "gloo:all_reduce" and "finish_grad_sync" in frames)
    signal_check = entry["profiling_name"] == "gloo:all_gather" and "signals_received" in frames
    return gradient_sync or signal_check


def _damage_the_newest_checkpoint_while_down(launcher, killed: psutil.Process, save) -> Path:
    """With the agent stopped (so it restarts nothing yet), wait until both ranks of the killed launch are gone,
    flip bytes in a shard of the newest checkpoint, and let the agent go on. Returns the damaged shard."""
    agent = psutil.Process(launcher.pid)
    try:
        deadline = time.time() + 120
        while any(p.status() != psutil.STATUS_ZOMBIE for p in agent.children(recursive=True) if p.pid != killed.pid):
            assert time.time() < deadline, [p.cmdline() for p in agent.children(recursive=True)]
            time.sleep(0.05)
        shard = sorted((save / f"iter_{int((save / 'latest_checkpointed_iteration.txt').read_text()):07d}")
                       .glob("*.distcp"))[0]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2:len(data) // 2 + 8] = bytes(b ^ 0xFF for b in data[len(data) // 2:len(data) // 2 + 8])
        shard.write_bytes(bytes(data))
        return shard.relative_to(save.parent)
    finally:
        os.kill(launcher.pid, signal.SIGCONT)


def test_faults_under_torchrun_restart_from_the_newest_checkpoint_and_the_ledger_names_them(tmp_path, uninterrupted):
    ledger = tmp_path / "ck" / "events.jsonl"
    bad_node = _zaya_torchrun(2, tmp_path, tmp_path / "bad-node.log", "bad_gemm@0@1")
    assert bad_node.wait(timeout=300) == 6, (tmp_path / "bad-node.log").read_text()[-3000:]
    (node_excluded,) = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert node_excluded["event"] == "node_excluded" and node_excluded["rank"] == 1, node_excluded
    assert node_excluded["cause"].startswith("self-test of rank 1 (cpu): a 512x512 float32 GEMM is off its "), \
        node_excluded

    log = tmp_path / "run.log"
    launcher = _zaya_torchrun(3, tmp_path, log, "first_crash@5@1")
    try:
        stopped = _signal_rank_1_after(launcher, log, restart=1, step=7, signum=signal.SIGSTOP)
        deadline = time.time() + 120
        while not HANG.search(log.read_text()):
            assert launcher.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        stopped.kill()  # what torchrun does to a worker that ignores its SIGTERM, 30 s later
        killed = _signal_rank_1_after(launcher, log, restart=2, step=7, signum=signal.SIGKILL,
                                      before=lambda: os.kill(launcher.pid, signal.SIGSTOP))
        damaged = _damage_the_newest_checkpoint_while_down(launcher, killed, tmp_path / "ck")
        assert launcher.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        if launcher.poll() is None:  # the launch's session, a stopped rank included
            os.killpg(launcher.pid, signal.SIGKILL)
    output = log.read_text()

    # Every launch repeats the steps it resumed with the same losses (2 ranks alike), and the curve equals the
    # one-process run's within float32 reordering (data parallelism sums in another order).
    printed: dict[int, set[float]] = {}
    for line in output.splitlines():
        for step, loss in losses(line).items():
            printed.setdefault(step, set()).add(loss)
    assert sorted(printed) == list(range(1, 10)) and all(len(v) == 1 for v in printed.values()), printed
    curve = loss_csv(tmp_path / "ck" / "loss.csv")
    assert sorted(curve) == list(range(1, 10))
    assert curve == pytest.approx({step: uninterrupted[step] for step in curve}, rel=1e-5), curve

    events = [json.loads(line) for line in ledger.read_text().splitlines()]
    launches = [e for e in events if e["event"] in ("start", "restart")]
    assert [(e["event"], e["step"]) for e in launches] == [("restart", 1), ("restart", 4), ("restart", 7),
                                                          ("restart", 4)], events
    assert launches[0]["cause"].startswith("node_excluded on rank 1 ("), launches[0]
    assert launches[1]["cause"].endswith("at step 5: RuntimeError: injected fault (ZAYA_FAULT_INJECT)"), launches[1]
    assert launches[1]["steps_lost"] == 1  # step 4 trained, its checkpoint was 3

    (hang,) = [e for e in events if e["event"] == "hang"]
    step, allowance = map(int, HANG.search(output).groups())
    assert hang["rank"] == 0 and hang["step"] == step and hang["cause"].startswith("no progress for "), hang
    assert launches[2]["cause"].startswith(f"hang on rank 0 ({hang['node']}) at step {step}: "), launches[2]
    # The time from the hang (the last progress) to the restarted run's first step: the allowance, then a start-up.
    start_up = _seconds(launches[2]) - _seconds(hang)
    assert hang["seconds_lost"] <= allowance + 1.5 and start_up < 60, (hang, start_up)
    assert launches[2]["seconds_lost"] == pytest.approx(hang["seconds_lost"] + start_up, abs=0.2), launches[2]
    assert launches[2]["steps_lost"] == step - 7
    # Rank 0's flight recorder: the gradients' data-parallel all-reduce never completed.
    recorder = tmp_path / "ck" / "flight-recorder" / hang["launch"].replace("/", "+") / "rank_0"
    assert f"zaya-pretrain: rank 0's flight recorder (its last collectives): {recorder.relative_to(tmp_path)}; " \
        in output
    trace = pickle.loads(recorder.read_bytes())
    # (Under load another group's collective may also be enqueued and not completed when the recorder dumps.)
    pending = {int(pg): s["last_enqueued_collective"] for pg, s in trace["pg_status"].items()
               if s["last_completed_collective"] < s["last_enqueued_collective"]}
    waiting = [e for e in trace["entries"] if pending.get(e["pg_id"]) == e["collective_seq_id"]]
    # Rank 1 stops just after logging step 7: either before the step's end, where Megatron's --exit-signal-handler
    # all-gathers every rank's signals, or in step 8's gradient sync, which all-reduces per data-parallel group (the
    # dense one's, then the experts': it can stop between the two). Rank 0 waits in one of these.
    assert [e for e in waiting if not e["retired"] and _waits_for_a_stopped_peer(e)], waiting
    # Rank 1 killed leaves no line of its own: rank 0's collective fails at the next step and names the lost peer.
    assert launches[3]["cause"].startswith("crash on rank 0 (") and "remote worker" in launches[3]["cause"], launches[3]
    # The damage found at the restart: it resumes from 3, and its loss reaches back there (steps 4-7).
    (skipped,) = [e for e in events if e["event"] == "checkpoint_skipped"]
    assert skipped["cause"] == f"{damaged.parent} ({damaged.name} differs from its checksum at save)", skipped
    assert damaged.parent.name == "iter_0000006" and skipped["launch"] == launches[3]["launch"], skipped
    assert skipped["step"] == 3 and skipped["steps_lost"] == 3 and launches[3]["steps_lost"] == 4, (skipped, launches)
    assert f"zaya-pretrain: warning: {skipped['cause']}: damaged; loading the newest intact checkpoint, " \
        "ck/iter_0000003 (iteration 3)" in output
    assert events[-1]["event"] == "end" and events[-1]["step"] == 9, events[-1]
    summary = [line for line in output.splitlines() if line.startswith("[zaya] event ledger ck/events.jsonl: ")]
    assert summary[-1].startswith("[zaya] event ledger ck/events.jsonl: launches 4, restarts 4, hangs 1, crashes 3, "
                                  "skipped steps 0, damaged checkpoints skipped 1, nodes excluded 1; lost to faults: "
                                  "steps 6, "), summary
