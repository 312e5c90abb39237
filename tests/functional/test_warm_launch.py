"""The suite's warm launches (``warm_launch``: forked from a zygote that imported torch) behave as fresh ones: the same
losses bit for bit, the same exit code and error line for bad input, and a signal to the client reaches the
launch, which saves and exits as a fresh launch does."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import warm_launch
from zaya_cli import KILLED_RUN, QUICK, loss_csv, pretrain

TIMES = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[.0-9]*|[0-9.]+ ?(ms|s)\b|\(seconds\): [0-9.]+")


def test_a_warm_launch_trains_and_fails_as_a_fresh_one(tmp_path):
    flags = QUICK + ["--train-iters", "3", "--save", "ck", "--save-interval", "3"]
    runs = {}
    for warm in (True, False):
        (tmp_path / str(warm)).mkdir()
        runs[warm] = pretrain(flags, cwd=tmp_path / str(warm), warm=warm)
        assert runs[warm].returncode == 0, runs[warm].stderr[-3000:]
    assert loss_csv(tmp_path / "True" / "ck" / "loss.csv") == loss_csv(tmp_path / "False" / "ck" / "loss.csv")
    assert TIMES.sub("T", runs[True].stderr) == TIMES.sub("T", runs[False].stderr)
    bad = [pretrain(QUICK + ["--train-iters", "0"], cwd=tmp_path, warm=warm) for warm in (True, False)]
    assert [run.returncode for run in bad] == [2, 2] and bad[0].stderr == bad[1].stderr, bad[0].stderr


def test_sigterm_to_the_client_stops_the_launch_as_it_stops_a_fresh_one(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("WORLD_SIZE", None)
    command = warm_launch.command("megatron_zaya.pretrain", KILLED_RUN + ["--save", "ck"], env)
    assert command is not None, "this worker's zygote did not start"
    with (tmp_path / "run.log").open("w") as log:
        client = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while "iteration        2/" not in (tmp_path / "run.log").read_text() and time.time() < deadline:
        time.sleep(0.1)
    client.send_signal(signal.SIGTERM)
    assert client.wait(timeout=300) == 0, (tmp_path / "run.log").read_text()[-3000:]
    saved = int((tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text())
    assert saved >= 2 and sorted(loss_csv(tmp_path / "ck" / "loss.csv")) == list(range(1, saved + 1))
