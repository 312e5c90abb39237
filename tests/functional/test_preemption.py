"""Pre-emption: SIGTERM (what Slurm and scancel send) makes zaya-pretrain save and exit 0 by default when it has a
--save directory; the next launch resumes; no process of the run outlives it."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

import psutil
from zaya_cli import QUICK, losses

from megatron_zaya.training.reliability import newest_intact_checkpoint


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
    """Processes still running in the run's session (the trainer and every helper it started)."""
    time.sleep(1)  # the kernel's signal to the helpers takes a moment
    left = []
    for process in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if os.getsid(process.pid) == session and process.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(" ".join(process.info["cmdline"] or [])[:200])
        except (ProcessLookupError, psutil.Error):
            pass
    return left


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
