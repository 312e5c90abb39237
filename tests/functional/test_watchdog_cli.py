"""``--zaya-watchdog-seconds`` through the CLI under torchrun's elastic agent: a rank whose forward hangs at step 5
is declared hung, writes its threads' stacks and exits 4; torchrun (``--max-restarts 1``) restarts it, the run
resumes from its newest checkpoint (step 3) and reaches its last step with the losses of an uninterrupted run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from zaya_cli import KILLED_RUN, loss_csv, losses, with_faults

FLAGS = KILLED_RUN + ["--save-interval", "3", "--exit-interval", "6", "--zaya-watchdog-seconds", "5"]


def test_a_hung_rank_is_restarted_from_the_newest_checkpoint(tmp_path, uninterrupted):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **with_faults("hang@5")}
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               "--max-restarts", "1", "-m", "megatron_zaya.pretrain", *FLAGS, "--save", "ck", "--load", "ck"]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    hang = [line for line in run.stderr.splitlines() if "made no progress" in line]
    assert len(hang) == 1 and hang[0].startswith("zaya-pretrain: error: rank 0 made no progress for "), hang
    assert " in iteration 5 " in hang[0], hang
    assert "forward_step_with_faults" in run.stderr  # the hung thread's stack, where it hangs
    printed = losses(run.stdout)  # 1-4 before the hang, 4-6 after the restart from step 3; 7 digits, float32
    assert printed == pytest.approx({step: uninterrupted[step] for step in range(1, 7)}, rel=1e-6), printed
    # the curve at full precision: the hung launch's steps up to its checkpoint (written with it), then the restart's
    assert loss_csv(tmp_path / "ck" / "loss.csv") == {step: uninterrupted[step] for step in range(1, 7)}
