"""A rank's checkpoint tensors staged to host memory in a thread and written in one pass (checkpoint/staging.py):
the bytes of every dtype and shape come back exactly, the checksums recorded while writing equal the files'
CRC-32, and equal those computed as the files are read back (into one host buffer, or each tensor on its own as
a device's), files split at their size limit, chunks span tensors and files, and the host pool is taken in
the save call and reused by the next save (and, smaller than the part, by its later files), or allocated at
start-up by a thread that the first save waits for, allocating nothing itself; a snapshot holds the
values of its moment when training changes the tensors as soon as :func:`wait_for_copies` returns, while the
copies run in another thread (here plain host copies, the path a GPU takes with device copies on the pool's
stream); a background save's tensors land in one reused buffer of the pool, each in a storage of its own."""

from __future__ import annotations

import math
import threading
import time
import zlib

import pytest
import torch

from megatron_zaya.checkpoint import staging
from megatron_zaya.checkpoint.staging import Snapshot, read_tensors, wait_for_copies


def _tensors() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(3, 5, generator=generator), torch.randn(7, generator=generator).to(torch.bfloat16),
            torch.arange(11, dtype=torch.int64), torch.tensor(2.5, dtype=torch.float64), torch.zeros(0),
            torch.tensor([True, False, True]), torch.randn(4, 6, generator=generator).t()]  # not contiguous


@pytest.mark.parametrize("most", [None, 2], ids=["a-pool-for-the-part", "two-buffers-reused"])
def test_tensors_come_back_exactly_with_the_checksums_of_their_files(tmp_path, monkeypatch, most):
    """Also through a pool of two buffers, each file waiting for the one two before it to be written."""
    monkeypatch.setitem(staging._pools, 40, staging.HostPool(40, most))
    tensors = _tensors()
    for attempt in ("first", "again"):  # the second save reuses the pool's buffers
        (tmp_path / attempt).mkdir()
        snapshot = Snapshot(tensors, limit=40, chunk=7)
        # The buffers are taken in the save call (the watchdog's pause), not by the copies the next step waits for.
        assert len(snapshot.pool.segments) == min(snapshot.files, snapshot.pool.most)
        table = snapshot.write(tmp_path / attempt, "tensors", threads=3)
        segments = [s.data_ptr() for s in snapshot.pool.segments]
        assert sorted(table) == [f"tensors.{i:03d}.bin" for i in range(len(table))] and len(table) > 4
        for name, (size, crc) in table.items():
            data = (tmp_path / attempt / name).read_bytes()
            assert size == len(data) <= 40 and crc == zlib.crc32(data), name
        paths = [tmp_path / attempt / name for name in sorted(table)]
        for devices in (None, ["cpu:0"] * len(tensors)):  # views of one buffer; each its own (a GPU's path)
            back = read_tensors(paths, snapshot.specs, devices, threads=3, chunk=5)
            assert back.crcs == [table[name][1] for name in sorted(table)]  # checksummed as read
            assert all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                       for a, b in zip(tensors, back.tensors, strict=True))
            storages = {t.untyped_storage().data_ptr() for t in back.tensors if t.numel()}
            assert len(storages) == (1 if devices is None else sum(t.numel() > 0 for t in tensors))
    assert [s.data_ptr() for s in staging._pools[40].segments] == segments
    assert len(segments) == (most or len(table))


def test_a_snapshot_holds_its_moment_while_training_changes_the_tensors(tmp_path, monkeypatch):
    """The copies (4 MiB in 4 KiB chunks, slowed) run in the tier's thread; the training thread waits for them
    only at :func:`wait_for_copies`, then overwrites every tensor; the files hold the values of the snapshot."""
    tensors = [torch.randn(1 << 18), torch.randn(512, 1024).t(), torch.arange(1 << 16)]
    expected = [t.clone() for t in tensors]
    fill = Snapshot._fill

    def slow_fill(self, piece, at):
        threading.Event().wait(0.0002)
        fill(self, piece, at)

    monkeypatch.setattr(Snapshot, "_fill", slow_fill)
    snapshot = Snapshot(tensors, chunk=4096)
    written = {}
    thread = threading.Thread(target=lambda: written.update(snapshot.write(tmp_path, "t")))
    thread.start()
    assert not snapshot._copied.is_set()  # the save returned with the copies still to run
    wait_for_copies()
    assert snapshot._copied.is_set()
    for tensor in tensors:
        tensor.mul_(-1).add_(3)  # the next optimizer step
    thread.join()
    assert list(written) == ["t.000.bin"]
    back = read_tensors([tmp_path / "t.000.bin"], snapshot.specs)
    assert all(torch.equal(a, b) for a, b in zip(back.tensors, expected, strict=True))
    assert snapshot.tensors == [] and staging._unfenced == []  # released once written; nothing left to wait for


def test_a_background_save_lands_in_one_reused_buffer_of_the_pool(monkeypatch):
    """``copy_to_host`` returns the tensors, exactly, each in a storage of its own size inside the pool's one
    buffer (the data's size), the same buffer at the next save; a larger save takes a larger buffer."""
    monkeypatch.setattr(staging, "_whole", [])
    tensors = _tensors()
    for attempt in ("first", "again"):
        snapshot = Snapshot(tensors, chunk=7, pool=staging.whole_pool(tensors))
        host = snapshot.copy_to_host()
        wait_for_copies()
        (buffer,) = staging._whole[0].segments
        assert buffer.numel() == snapshot.end and (attempt == "first" or buffer.data_ptr() == first)
        first = buffer.data_ptr()
        for tensor, copy in zip(tensors, host, strict=True):
            assert copy.dtype == tensor.dtype and copy.shape == tensor.shape and torch.equal(copy, tensor)
            storage = copy.untyped_storage()
            assert storage.nbytes() == tensor.nbytes and (
                not tensor.nbytes or first <= storage.data_ptr() < first + buffer.numel())
    assert staging.whole_pool(tensors + [torch.ones(1000)]).segment == -(-snapshot.end // 64) * 64 + 4000


@pytest.mark.parametrize("whole", [False, True], ids=["local-tier", "background"])
def test_a_pool_allocated_at_start_up_serves_the_first_save(tmp_path, monkeypatch, whole):
    """The pool allocated at start-up by its thread, held back for 0.2 s: the save waits for its release
    and copies into its buffers, allocating none; for the part it was sized for, or a little larger (the
    background save's one buffer is rounded up to whole files)."""
    monkeypatch.setattr(staging, "_pools", {})
    monkeypatch.setattr(staging, "_whole", [])
    monkeypatch.setattr(staging, "FILE_BYTES", 40)
    tensors, go, allocated_by = _tensors(), threading.Event(), []
    buffer = staging.HostPool._buffer

    def held_back(self):
        go.wait()
        allocated_by.append(threading.current_thread().name)
        return buffer(self)

    monkeypatch.setattr(staging.HostPool, "_buffer", held_back)
    end = staging._offsets([t.nbytes for t in tensors])[1]
    # The plan's part: the save's (local tier), or a little smaller, within its rounding up to whole files
    staging.allocate_pool(40 * (math.ceil(end / 40) - 1) + 1 if whole else end, whole)
    pool = staging._whole[0] if whole else staging._pools[40]
    released_at = []
    threading.Timer(0.2, lambda: (released_at.append(time.perf_counter()), go.set())).start()
    snapshot = Snapshot(tensors, limit=40, chunk=7, pool=staging.whole_pool(tensors) if whole else None)
    returned_at = time.perf_counter()
    assert released_at and returned_at > released_at[0] and snapshot.pool is pool  # it waited for the pool
    before = [s.data_ptr() for s in pool.segments]
    if whole:
        back = snapshot.copy_to_host()
    else:
        table = snapshot.write(tmp_path, "t", threads=3)
        back = read_tensors([tmp_path / name for name in sorted(table)], snapshot.specs).tensors
    assert all(torch.equal(a, b) for a, b in zip(tensors, back, strict=True))
    assert [s.data_ptr() for s in pool.segments] == before
    assert allocated_by == ["zaya-host-pool"] * (1 if whole else math.ceil(end / 40))  # none by the save
