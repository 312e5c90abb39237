"""Background saves (``--async-save``) and the local tier in real runs: the whole job SIGKILLed as checkpoint
8's background save starts leaves both tiers resumable, and a resume from either tier repeats the killed run's
losses; killed once its writer has begun the data files of a checkpoint, ``latest`` stays intact; a write still
in flight when the run ends is finished and checksummed; two data-parallel ranks resume from a background save
exactly; the host pools of both tiers are allocated at start-up."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from shared import once
from zaya_cli import KILLED_RUN, QUICK, assert_resumed_exactly, loss_csv, losses, pretrain, with_faults

from megatron_zaya.checkpoint import CHECKSUMS, TRACKER, newest_intact_checkpoint

PERSISTENT = ["--async-save", "--save-interval", "4", "--save", "ck", "--load", "ck"]
TIERS = PERSISTENT + ["--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", "local",
                      "--non-persistent-save-interval", "1"]
FLAGS = KILLED_RUN


def _killed_when(directory, ready, tiers=TIERS, faults: str = "") -> dict[int, float]:
    """A run with ``tiers`` (both by default) and the injected ``faults``, its process group SIGKILLed the moment
    ``ready()`` holds; its losses."""
    with (directory / "killed.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "megatron_zaya.pretrain", *FLAGS, *tiers], cwd=directory,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(with_faults(faults) if faults else {})})
    deadline = time.time() + 400
    while not ready() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.001)
    os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its background writer, as a node failure would
    proc.wait(timeout=60)
    output = (directory / "killed.log").read_text()
    assert ready() and "Traceback" not in output, output[-3000:]
    return losses(output)


@pytest.fixture
def killed(tmp_path_factory):
    """A run with both tiers, killed the moment the directory of checkpoint 8 appears (its background write
    starting, local checkpoints of 6 and 7 written or being written); its directory and losses."""
    directory = once(tmp_path_factory, "killed-with-both-tiers",
                     lambda directory: _killed_when(directory, (directory / "ck" / "iter_0000008").exists))
    return directory, losses((directory / "killed.log").read_text())


def _copy(killed, tmp_path):
    for name in ("ck", "local"):
        shutil.copytree(killed[0] / name, tmp_path / name)


def test_the_kill_leaves_complete_checkpoints_in_both_tiers(killed):
    directory, first = killed
    ckpt, local = directory / "ck", directory / "local"
    assert (ckpt / TRACKER).read_text() == "4"  # 8 was being written: never named
    assert not (ckpt / "iter_0000008" / CHECKSUMS).exists()
    assert newest_intact_checkpoint(str(ckpt)) == "4"
    # Each local part kept (the newest two, plus one a later save may have completed before its pruning) is
    # complete or was still being written; nothing older than 5 is left.
    parts = sorted(int(p.parent.name[5:]) for p in local.glob("iter_*/rank_00000"))
    assert parts and min(parts) >= 5 and max(parts) <= 7 and max(first) >= 8, (parts, max(first))
    # Both pools were allocated at start-up, before the first save: --async-save's one buffer, the local tier's.
    output = (directory / "killed.log").read_text()
    for pool in ("background", "local-tier"):
        line = output.find(f"[zaya] host pool of {pool} saves allocated at start-up")
        assert 0 <= line < output.index("saving checkpoint at iteration"), output[-3000:]


def test_a_resume_takes_the_newest_local_checkpoint_and_repeats_the_losses(killed, tmp_path, uninterrupted):
    """The local tier is newer than the persistent one (4): the resume starts there and its first loss equals the
    killed run's. The background saves of this run (persistent 8, local 9 and 10, the last one still in flight
    at the exit interval) are finished, checksummed and named before the run ends."""
    _copy(killed, tmp_path)
    complete = sorted(int(p.parent.parent.name[5:]) for p in (tmp_path / "local").glob(f"iter_*/rank_*/{CHECKSUMS}"))
    run = pretrain(FLAGS + TIERS + ["--exit-interval", "10"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    resumed = losses(run.stdout)
    start = min(resumed) - 1
    assert start == complete[-1] >= 6, (start, complete)
    assert f"[zaya] resuming from the local checkpoint local/iter_{start:07d} (the persistent one in --load: 4)" \
        in run.stdout
    assert_resumed_exactly(loss_csv(tmp_path / "ck" / "loss.csv"), range(min(resumed), max(resumed) + 1),
                           killed[1], resumed, uninterrupted)
    assert max(resumed) == 10 and (tmp_path / "ck" / TRACKER).read_text() == "8"
    assert "] [zaya] local checkpoint of iteration 10 complete on every rank in " in run.stdout  # by its thread
    assert newest_intact_checkpoint(str(tmp_path / "ck")) == "8"
    assert sorted(p.parent.parent.name for p in (tmp_path / "local").glob(f"iter_*/rank_00000/{CHECKSUMS}")) == [
        "iter_0000009", "iter_0000010"]


def test_a_resume_from_the_background_save_repeats_the_losses(killed, tmp_path, uninterrupted):
    """Without the local tier the resume starts at the persistent checkpoint 4 that the background writer
    wrote while steps 5 and on trained: losses 5 to 7 equal the killed run's and the uninterrupted run's."""
    _copy(killed, tmp_path)
    run = pretrain(FLAGS + PERSISTENT + ["--exit-interval", "7"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    resumed = losses(run.stdout)
    assert min(resumed) == 5 and max(resumed) == 7
    assert_resumed_exactly(loss_csv(tmp_path / "ck" / "loss.csv"), range(min(resumed), max(resumed) + 1),
                           killed[1], resumed, uninterrupted)


def test_a_kill_while_the_writer_writes_leaves_an_intact_latest(tmp_path):
    """Killed the moment the background writer has created the first data file of checkpoint 8 (mid-write; the
    persistent tier alone), its write of 4 slowed so that it ends only as the save of 8 begins: ``latest`` names
    4, whose every file matches its checksums (what a resume loads, as the tests above show)."""
    ck = tmp_path / "ck"
    _killed_when(tmp_path, lambda: any((ck / "iter_0000008").glob("*.distcp")), PERSISTENT, "slow_write@4")
    assert newest_intact_checkpoint(str(ck)) == (ck / TRACKER).read_text() == "4"


def test_two_ranks_resume_exactly_from_a_background_save(tmp_path):
    """Two gloo ranks (distributed optimizer, overlapped reductions) save in the background at steps 3 and 6, each
    trainer's thread staging its part through the host pool and writing it, with ``--dist-ckpt-workers`` threads
    into as many files, while the next steps train; a relaunch from 3 repeats that run's losses 4-6 bit for bit."""
    flags = QUICK + ["--train-iters", "6", "--async-save", "--save-interval", "3", "--save", "ck", "--load", "ck",
                     "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                     "--dist-ckpt-workers", "3"]
    first = pretrain(flags, cwd=tmp_path, nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.count("[zaya] background save written in ") == 2, first.stdout[-3000:]
    for step in ("iter_0000003", "iter_0000006"):
        files = sorted(path.name for path in (tmp_path / "ck" / step).glob("*.distcp"))
        assert files == [f"__{rank}_{thread}.distcp" for rank in (0, 1) for thread in range(3)], files
    uninterrupted = loss_csv(tmp_path / "ck" / "loss.csv")
    assert sorted(uninterrupted) == list(range(1, 7)) and newest_intact_checkpoint(str(tmp_path / "ck")) == "6"
    (tmp_path / "ck" / TRACKER).write_text("3")
    resumed = pretrain(flags, cwd=tmp_path, nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(resumed.stdout) == {step: losses(first.stdout)[step] for step in (4, 5, 6)}
    assert loss_csv(tmp_path / "ck" / "loss.csv") == uninterrupted
