"""Reliability pieces that need no training run: damaged datasets, the atomic `latest` marker under
SIGKILL and after an incomplete save, the SIGTERM deadline, an unusable --save directory (docs/reliability.md)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_zaya.data import embedded_tokenizer_dir
from megatron_zaya.data.preprocess import write_indexed_dataset
from megatron_zaya.errors import UsageError
from megatron_zaya.training.data_checks import indexed_dataset_problem
from megatron_zaya.checkpoint.save_failures import check_save_dir
from megatron_zaya.training.reliability import GUARD, arm_sigterm_deadline

TRACKER = "latest_checkpointed_iteration.txt"


def _dataset(directory, name, texts):
    source = directory / f"{name}.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prefix = str(directory / name)
    write_indexed_dataset([str(source)], prefix, embedded_tokenizer_dir(), progress=False)
    return prefix


@pytest.fixture(scope="module")
def sound(tmp_path_factory):
    directory = tmp_path_factory.mktemp("data")
    return _dataset(directory, "sound", ["It is a truth universally acknowledged. " * 40] * 6)


def _copy(prefix, directory, name):
    for suffix in (".bin", ".idx"):
        shutil.copy(prefix + suffix, directory / (name + suffix))
    return str(directory / name)


def test_sound_dataset_passes(sound):
    assert indexed_dataset_problem(sound, seq_length=64) is None


def test_truncated_bin_is_named(sound, tmp_path):
    broken = _copy(sound, tmp_path, "cut")
    with open(broken + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(broken + ".bin") - 100)
    with pytest.raises(Exception):  # the fault is real: Megatron cannot read the last document
        IndexedDataset(broken)[len(IndexedDataset(broken)) - 1]
    problem = indexed_dataset_problem(broken, seq_length=64)
    assert f"{broken}.bin" in problem and "truncated" in problem and "zaya-preprocess" in problem, problem


@pytest.mark.parametrize("damage", ["header", "truncated"])
def test_damaged_idx_is_named(sound, tmp_path, damage):
    broken = _copy(sound, tmp_path, damage)
    with open(broken + ".idx", "r+b") as f:
        if damage == "header":
            f.write(b"GARBAGE!!")
        else:
            f.truncate(os.path.getsize(broken + ".idx") - 8)
    with pytest.raises(Exception):  # Megatron's own reader fails on it (with an assert or a buffer error)
        IndexedDataset(broken)
    problem = indexed_dataset_problem(broken, seq_length=64)
    assert f"{broken}.idx" in problem and "zaya-preprocess" in problem, problem


def test_dataset_shorter_than_one_sequence(tmp_path):
    prefix = _dataset(tmp_path, "short", ["Emma."])
    tokens = sum(len(IndexedDataset(prefix)[i]) for i in range(len(IndexedDataset(prefix))))
    assert tokens < 65
    problem = indexed_dataset_problem(prefix, seq_length=64)
    assert problem == (f"{prefix} holds {tokens} tokens, fewer than one training sequence (--seq-length 64 + 1); "
                       "add data or shorten --seq-length")
    assert indexed_dataset_problem(prefix, seq_length=tokens - 1) is None


KILLED_WRITER = textwrap.dedent("""
    import os, sys
    from megatron_zaya.patches.reliability import _AtomicTrackerStorage
    from megatron.core.msc_utils import maybe_msc
    storage = _AtomicTrackerStorage(maybe_msc) if sys.argv[2] == "atomic" else maybe_msc
    os.replace = lambda *paths: os.kill(os.getpid(), 9)  # the atomic writer, killed before its rename
    with storage.open(sys.argv[1], "w") as f:
        if sys.argv[2] == "stock":  # Megatron's in-place rewrite, killed between truncation and write
            os.kill(os.getpid(), 9)
        f.write("7")
""")


@pytest.mark.parametrize("writer", ["atomic", "stock"])
def test_sigkill_while_replacing_the_latest_marker(tmp_path, writer):
    """SIGKILL with the new checkpoint's data written and its marker half-replaced: the atomic marker
    still names the previous checkpoint; Megatron's in-place rewrite leaves it empty (what the patch fixes)."""
    tracker = tmp_path / TRACKER
    tracker.write_text("3")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(tracker), writer], cwd=root, capture_output=True,
                         text=True)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    assert tracker.read_text() == ("3" if writer == "atomic" else "")


def test_sigterm_deadline_exits_when_the_save_does_not_finish(tmp_path, capsys, monkeypatch):
    """Before the first step SIGTERM keeps its default action (the process ends at once); from the first step on,
    exit 3 at the deadline."""
    (tmp_path / TRACKER).write_text("12")
    monkeypatch.setattr(GUARD, "at_first_step", lambda: None)
    exits = []
    originals = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        arm_sigterm_deadline(0.3, str(tmp_path), exit=exits.append)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        GUARD.at_first_step()
        assert signal.getsignal(signal.SIGTERM) == signal.getsignal(signal.SIGINT)
        start = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        while not exits and time.monotonic() - start < 10:
            time.sleep(0.01)
        elapsed = time.monotonic() - start
    finally:
        for sig, handler in originals.items():
            signal.signal(sig, handler)
    assert exits == [3] and 0.3 <= elapsed < 5.0, (exits, elapsed)  # at the deadline, not never
    assert f"{tmp_path}/iter_0000012 (iteration 12)" in capsys.readouterr().err


def test_unwritable_save_dir(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(UsageError, match=f"--save {blocker}/ckpt is not writable"):
        check_save_dir(str(blocker / "ckpt"))


def test_a_full_disk_is_named_as_such(tmp_path, monkeypatch):
    def no_space(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    monkeypatch.setattr(Path, "write_bytes", no_space)  # what a write on a full disk raises
    with pytest.raises(UsageError, match=rf"^--save {tmp_path}/ckpt: the disk is full \(ENOSPC: No space left on "
                                         r"device\); free space or choose another --save$"):
        check_save_dir(str(tmp_path / "ckpt"))


def test_save_dir_without_room_for_the_next_checkpoint(tmp_path):
    save = tmp_path / "ckpt"
    (save / "iter_0000005").mkdir(parents=True)
    (save / TRACKER).write_text("5")
    check_save_dir(str(save))  # a small checkpoint fits
    with open(save / "iter_0000005" / "weights.distcp", "wb") as f:  # sparse: its size, not its blocks
        f.truncate(shutil.disk_usage(save).free + 2**30)
    with pytest.raises(UsageError, match="GiB free but its last checkpoint .iter_0000005. takes"):
        check_save_dir(str(save))


def test_latest_moves_only_past_a_checked_save_whose_checksums_the_writers_recorded(tmp_path):
    """A torch_dist save whose writer recorded its file: the tracker write takes that record (a recorded CRC is
    not recomputed) and names the step; the same save with its data file cut short is refused, ``latest`` kept."""
    import torch
    import torch.distributed.checkpoint as dcp
    from megatron.core.msc_utils import maybe_msc

    from megatron_zaya.checkpoint import CHECKSUMS, check_written, record_written, recorded_files
    from megatron_zaya.errors import CheckpointError
    from megatron_zaya.patches.reliability import _AtomicTrackerStorage

    step = tmp_path / "iter_0000002"
    dcp.save({"w": torch.arange(4096.0)}, checkpoint_id=str(step), no_dist=True)
    [data] = step.glob("*.distcp")
    (tmp_path / TRACKER).write_text("1")
    check_written(step)
    record_written([data], rank=0)
    record = step / f".{CHECKSUMS}.rank-00000"
    table = json.loads(record.read_text())
    table["files"][data.name][1] = 12345  # what the writer says, not what a second read would find
    record.write_text(json.dumps(table))
    with _AtomicTrackerStorage(maybe_msc).open(str(tmp_path / TRACKER), "w") as f:
        f.write("2")
    assert (tmp_path / TRACKER).read_text() == "2" and not record.exists()
    assert recorded_files(step)[data.name] == [data.stat().st_size, 12345]

    data.write_bytes(data.read_bytes()[:100])
    (tmp_path / TRACKER).write_text("1")
    with pytest.raises(CheckpointError, match=f"{data.name} has 100 bytes, but the checkpoint's .metadata places"):
        with _AtomicTrackerStorage(maybe_msc).open(str(tmp_path / TRACKER), "w") as f:
            f.write("2")
    assert (tmp_path / TRACKER).read_text() == "1" and not list(tmp_path.glob(f"{TRACKER}.tmp-*"))


def test_the_background_writer_lives_until_the_run_ends(monkeypatch):
    """``checkpointing.one_writer_per_run``: the writer-closing call at the end of Megatron's ``train`` only
    finalizes (``pretrain`` then saves the last step with the same writer and closes it); a ``train`` that
    raises (``sys.exit`` at ``--exit-interval``) closes it on the way out."""
    import megatron.training.training as training

    from megatron_zaya.patches.checkpointing import one_writer_per_run

    calls = []

    def train(stop: bool):  # what Megatron's ends with (training.py:4120), then its sys.exit on early exits
        training.maybe_finalize_async_save(blocking=True, terminate=True)
        if stop:
            sys.exit(0)
        return "trained"

    monkeypatch.setattr(training, "train", train)
    monkeypatch.setattr(training, "maybe_finalize_async_save",
                        lambda blocking=False, terminate=False: calls.append((blocking, terminate)))
    one_writer_per_run()
    assert training.train(False) == "trained" and calls == [(True, False)]
    training.maybe_finalize_async_save(blocking=True, terminate=True)  # pretrain's, after its last save
    assert calls[-1] == (True, True)
    calls.clear()
    with pytest.raises(SystemExit):
        training.train(True)
    assert calls == [(True, False), (True, True)]
