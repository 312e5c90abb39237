"""Pre-emption: SIGTERM (what Slurm sends) makes zaya-pretrain save and exit 0; the next launch resumes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from zaya_cli import QUICK, losses, pretrain


def test_sigterm_saves_and_the_next_launch_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = QUICK + ["--train-iters", "400", "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "1000",
                     "--exit-signal-handler"]
    log = (tmp_path / "first.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "megatron_zaya.pretrain", *flags], cwd=tmp_path, stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 300
    while time.time() < deadline and not losses((tmp_path / "first.log").read_text()).get(3):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 0
    trained = max(losses((tmp_path / "first.log").read_text()))
    assert 3 <= trained < 400
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert saved >= trained

    resumed = pretrain(flags[:-1] + ["--exit-interval", str(saved + 2)], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert min(losses(resumed.stdout)) == saved + 1  # continues where the signal stopped it
