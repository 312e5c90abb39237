"""``--zaya-watchdog-seconds`` through the CLI under torchrun's elastic agent: a rank whose forward hangs at step 4
is declared hung, writes its threads' stacks and exits 4; torchrun (``--max-restarts 1``) restarts it, the run
resumes from its newest checkpoint (step 2) and reaches its last step with the losses of an uninterrupted run."""

from __future__ import annotations

import os
import subprocess
import sys

from zaya_cli import QUICK, losses, pretrain, with_faults

FLAGS = QUICK + ["--train-iters", "6", "--save-interval", "2", "--zaya-watchdog-seconds", "5"]


def test_a_hung_rank_is_restarted_from_the_newest_checkpoint(tmp_path):
    reference = pretrain(FLAGS + ["--save", "ref", "--load", "ref"], cwd=tmp_path)
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = losses(reference.stdout)

    env = {**os.environ, "PYTHONUNBUFFERED": "1", **with_faults("hang@4")}
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               "--max-restarts", "1", "-m", "megatron_zaya.pretrain", *FLAGS, "--save", "ck", "--load", "ck"]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    hang = [line for line in run.stderr.splitlines() if "made no progress" in line]
    assert len(hang) == 1 and hang[0].startswith("zaya-pretrain: error: rank 0 made no progress for "), hang
    assert " in iteration 4 " in hang[0], hang
    assert "forward_step_with_faults" in run.stderr  # the hung thread's stack, where it hangs
    got = losses(run.stdout)
    assert sorted(got) == list(range(1, 7)), got  # 1-3 before the hang, 3-6 after the restart from step 2
    assert got == expected, (got, expected)
