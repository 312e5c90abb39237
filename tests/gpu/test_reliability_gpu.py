"""On GPUs: exact resume with Megatron's distributed optimizer and from a background save written while training
went on (its device copies read by the writer process through IPC), and a one-rank NaN skipped on every rank.

Runs zaya-pretrain under torchrun on up to two GPUs (data parallel) in bf16 with --use-distributed-optimizer
(Adam: Megatron's sharded optimizer; zaya_muon: its own data-parallel sharding of Newton-Schulz and momentum).
``--deterministic-mode`` makes GPU runs repeat bit for bit, so resumed losses must equal the uninterrupted ones.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from zaya_cli import with_faults

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")

GPUS = min(torch.cuda.device_count(), 2) if torch.cuda.is_available() else 0
FLAGS = ["--seq-length", "128", "--micro-batch-size", "4", "--global-batch-size", "16", "--lr-warmup-iters", "2",
         "--eval-iters", "0", "--log-interval", "1", "--bf16", "--use-distributed-optimizer", "--train-iters", "20",
         "--save-interval", "10", "--zaya-replica-check-interval", "5", "--deterministic-mode"]


def _pretrain(args, cwd, extra_env=None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={GPUS}",
               "-m", "megatron_zaya.pretrain", *FLAGS, *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)


def _loss_csv(path):
    rows = path.read_text().splitlines()[1:]
    return {int(i): float(v) for i, v in (row.split(",") for row in rows)}


@pytest.mark.parametrize("optimizer", ["adam", "zaya_muon"])
def test_exact_resume_with_the_distributed_optimizer(tmp_path, optimizer):
    full, part = tmp_path / "full", tmp_path / "part"
    opt = ["--optimizer", optimizer] + (["--lr", "0.02"] if optimizer == "zaya_muon" else [])
    run = _pretrain(opt + ["--save", str(full), "--load", str(full)], tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    first = _pretrain(opt + ["--save", str(part), "--load", str(part), "--exit-interval", "10"], tmp_path)
    assert first.returncode == 0, first.stderr[-4000:]
    resumed = _pretrain(opt + ["--save", str(part), "--load", str(part)], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    before, after = _loss_csv(full / "loss.csv"), _loss_csv(part / "loss.csv")
    assert sorted(after) == list(range(11, 21))
    assert all(after[i] == before[i] for i in after), (after, before)


def test_exact_resume_from_a_background_save_written_while_training_went_on(tmp_path):
    opt = ["--optimizer", "zaya_muon", "--lr", "0.02"]
    full, background, again = tmp_path / "full", tmp_path / "background", tmp_path / "again"
    for args in (["--save", str(full), "--load", str(full)],
                 ["--save", str(background), "--load", str(background), "--async-save"],
                 ["--save", str(again), "--load", str(background), "--ckpt-step", "10"]):
        run = _pretrain(opt + args, tmp_path)
        assert run.returncode == 0, run.stderr[-4000:]
    before, after = _loss_csv(full / "loss.csv"), _loss_csv(again / "loss.csv")
    assert sorted(after) == list(range(11, 21))
    assert all(after[i] == before[i] for i in after), (after, before)


def test_nan_on_one_rank_is_skipped_everywhere(tmp_path):
    run = _pretrain(["--train-iters", "8", "--save-interval", "100"], tmp_path,
                    with_faults(f"nan_grad@3@{GPUS - 1}"))
    assert run.returncode == 0, run.stderr[-4000:]
    out = run.stdout + run.stderr
    assert re.search(r"iteration\s+3 \| non-finite step skipped", out), out[-4000:]
    assert re.findall(r"iteration\s+(\d+) \| data-parallel replicas identical", out) == (["5"] if GPUS > 1 else [])
