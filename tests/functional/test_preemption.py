"""Pre-emption: SIGTERM (what Slurm and scancel send) makes zaya-pretrain save and exit 0 by default when it has a
--save directory; the next launch resumes; no process of the run outlives it. Under zaya-torchrun the launcher
exits 0 too when every rank did."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

import psutil
import pytest
from zaya_cli import KILLED_RUN, QUICK, loss_csv, losses

from megatron_zaya.checkpoint import newest_intact_checkpoint


def _launch(flags, tmp_path, name):
    log = (tmp_path / f"{name}.log").open("w")
    return subprocess.Popen([sys.executable, "-m", "megatron_zaya.pretrain", *flags], cwd=tmp_path, stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            start_new_session=True)


def _wait_for(proc, log, seen):
    """Until ``seen(output)``; the run must still be going."""
    deadline = time.time() + 300
    while time.time() < deadline and not seen(log.read_text()):
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.5)


def _start(flags, tmp_path, name):
    proc = _launch(flags, tmp_path, name)
    _wait_for(proc, tmp_path / f"{name}.log", lambda output: losses(output).get(3))
    return proc


def _left_in_session(session: int) -> list[str]:
    """Processes still running in the run's session (the trainer and every helper it started) 10 s on, or as soon
    as none is: the kernel's signal to the helpers, and their exit, take a moment (a process being torn down already
    shows an empty command line)."""
    deadline = time.monotonic() + 10
    while True:
        left = []
        for process in psutil.process_iter(["pid", "cmdline", "status"]):
            try:
                if os.getsid(process.pid) == session and process.info["status"] != psutil.STATUS_ZOMBIE:
                    left.append(" ".join(process.info["cmdline"] or [])[:200])
            except (ProcessLookupError, psutil.Error):
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_sigterm_saves_by_default_and_the_next_launch_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = QUICK + ["--train-iters", "400", "--save", str(ckpt), "--save-interval", "1000"]  # no --load
    proc = _start(flags, tmp_path, "first")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, (tmp_path / "first.log").read_text()[-3000:]
    assert _left_in_session(proc.pid) == []
    output = (tmp_path / "first.log").read_text()
    trained = max(losses(output))
    assert f"; resume with: zaya-pretrain {shlex.join(flags)}\n" in output, output[-3000:]
    assert 3 <= trained < 400
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert saved >= trained
    assert newest_intact_checkpoint(str(ckpt)) == str(saved)  # the save on SIGTERM has its checksums

    # The same command resumes. With the save turned off (--zaya-sigterm-deadline 0) SIGTERM ends the resumed run
    # at once, with every helper it started (data-loader workers and the like), and the checkpoint stays.
    resumed, log = _launch(flags + ["--zaya-sigterm-deadline", "0"], tmp_path, "resumed"), tmp_path / "resumed.log"
    _wait_for(resumed, log, lambda output: losses(output).get(saved + 1))
    assert min(losses(log.read_text())) == saved + 1  # continues where the signal stopped it
    resumed.send_signal(signal.SIGTERM)
    assert resumed.wait(timeout=60) == -signal.SIGTERM
    assert _left_in_session(resumed.pid) == []
    assert int((ckpt / "latest_checkpointed_iteration.txt").read_text()) == saved


def test_sigkill_leaves_no_process(tmp_path):
    """SIGKILL: the trainer ends at once, and so does every helper it started, without waiting for a scheduler
    to end the job."""
    ckpt = tmp_path / "ckpt"
    flags = QUICK + ["--train-iters", "400", "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "1000"]
    proc = _start(flags, tmp_path, "run")
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert _left_in_session(proc.pid) == []
    assert not (ckpt / "latest_checkpointed_iteration.txt").exists()


def _launch_under(launcher: str, argv: list[str], cwd, log):
    """``launcher`` (a module: ``megatron_zaya.launch`` is zaya-torchrun) running ARGV on two local ranks, in a
    session of its own as a job step is."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("WORLD_SIZE", None)
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, "-m", launcher, "--standalone", "--nproc-per-node", "2", *argv],
                                cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def test_sigterm_to_zaya_torchrun_saves_on_both_ranks_and_exits_0(tmp_path, uninterrupted):
    """SIGTERM to the launcher's process group (scancel, the sbatch script's requeue): zaya-torchrun passes it to
    the two gloo ranks, which save and exit 0, and exits 0 itself (torchrun exits 1: its agent raises the signal
    again once the workers are gone). The same command resumes with the one-process run's losses."""
    ckpt = tmp_path / "ckpt"
    flags = KILLED_RUN + ["--save", str(ckpt), "--save-interval", "1000"]
    log = tmp_path / "run.log"
    proc = _launch_under("megatron_zaya.launch", ["-m", "megatron_zaya.pretrain", *flags], tmp_path, log)
    _wait_for(proc, log, lambda output: losses(output).get(3))
    ranks = psutil.Process(proc.pid).children(recursive=True)

    os.killpg(proc.pid, signal.SIGTERM)

    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    output = log.read_text()
    assert "zaya-torchrun: stopped by SIGTERM; all 2 workers exited 0 after it: exit 0" in output
    assert f"; resume with: zaya-torchrun ... -m megatron_zaya.pretrain {shlex.join(flags)}\n" in output
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert saved == max(losses(output)) and 3 <= saved < max(uninterrupted)  # the step the signal found
    assert newest_intact_checkpoint(str(ckpt)) == str(saved)  # both ranks' files, checksums recorded
    assert not [rank.pid for rank in ranks if rank.is_running() and rank.status() != psutil.STATUS_ZOMBIE]

    resumed = tmp_path / "resumed.log"
    argv = ["-m", "megatron_zaya.pretrain", *flags, "--exit-interval", str(saved + 1)]
    assert _launch_under("megatron_zaya.launch", argv, tmp_path, resumed).wait(timeout=300) == 0, resumed.read_text()
    curve = loss_csv(ckpt / "loss.csv")
    assert min(losses(resumed.read_text())) == saved + 1 and sorted(curve) == list(range(1, saved + 2))
    for step in curve:  # data parallelism sums the same gradients in another order
        assert abs(curve[step] - uninterrupted[step]) <= 1e-5 * uninterrupted[step], (step, curve, uninterrupted)


@pytest.mark.parametrize(("exit_codes", "launcher_exit"), [("0,0", 0), ("0,3", 1)])
def test_zaya_torchrun_exits_0_after_a_signal_only_when_every_worker_did(exit_codes, launcher_exit, tmp_path):
    """A rank whose save failed (exit 3 on SIGTERM) still fails the launch."""
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import os, signal, sys, time\n"
        f"code = [{exit_codes}][int(os.environ['LOCAL_RANK'])]\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(code))\n"
        "print('ready', flush=True)\n"
        "time.sleep(120)\n")
    log = tmp_path / "launch.log"
    proc = _launch_under("megatron_zaya.launch", [str(worker)], tmp_path, log)
    _wait_for(proc, log, lambda output: output.count("ready") == 2)

    os.killpg(proc.pid, signal.SIGTERM)

    assert proc.wait(timeout=60) == launcher_exit, log.read_text()[-3000:]
