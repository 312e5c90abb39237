"""A snapshot of device tensors (checkpoint/staging.py) on a GPU: its copies on the pool's stream see the work
queued before it, the training stream's writes queued after :func:`wait_for_copies` do not reach them, and the
device holds no copy of the state (at most a chunk or two of a non-contiguous tensor); read back onto the device
(from pinned chunks, on a stream per file), the tensors are the snapshot's; the pool pinned at start-up by its
thread serves the save; the save call's timer does not wait for the copies."""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_zaya.checkpoint import staging
from megatron_zaya.checkpoint.staging import CHUNK_BYTES, Snapshot, read_tensors, wait_for_copies

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")


def test_a_snapshot_of_device_tensors_holds_its_moment(tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "_pools", {})
    generator = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randn(1 << 26, device="cuda", generator=generator),  # 256 MiB
               torch.randn(4096, 8192, device="cuda", generator=generator).t(),  # not contiguous, 128 MiB
               torch.arange(1 << 20, device="cuda")]
    expected = [t.cpu() + 1 for t in tensors]
    busy = torch.randn(8192, 8192, device="cuda", generator=generator)
    for _ in range(30):
        busy = torch.tanh(busy @ busy)  # the step still running when the save is taken
    for tensor in tensors:
        tensor.add_(busy[0, 0].clamp(2, 2).to(tensor.dtype) - 1)  # + 1, queued behind it
    staging.allocate_pool(sum(t.nbytes for t in tensors), whole=False)  # pinned in its thread, as at start-up
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    snapshot = Snapshot(tensors)
    assert snapshot.pool.segments and all(s.is_pinned() for s in snapshot.pool.segments)
    thread = threading.Thread(target=lambda: snapshot.write(tmp_path, "t"))
    thread.start()
    wait_for_copies()
    for tensor in tensors:
        tensor.mul_(-1)  # the next optimizer step, on the training stream
    thread.join()
    assert torch.cuda.max_memory_allocated() - before <= 2 * CHUNK_BYTES
    back = read_tensors(sorted(tmp_path.glob("t.*.bin")), snapshot.specs, ["cuda"] * len(tensors), chunk=1 << 20)
    assert all(a.is_cuda and torch.equal(a.cpu(), b) for a, b in zip(back.tensors, expected, strict=True))


def test_the_save_timers_wait_for_the_training_stream_not_for_the_copies():
    """A save call's timer (``checkpointing.save_timers_on_training_stream``) ends once the training stream's work
    is done, while copies on another stream run on; Megatron's own timer waits for both."""
    from megatron.core.timers import Timers

    from megatron_zaya.patches.checkpointing import SAVE_TIMERS, time_on_training_stream

    timers = Timers(0, "minmax")
    save, megatrons = timers(SAVE_TIMERS[0], log_level=0), timers("reference", log_level=0)
    time_on_training_stream(save)
    copies = torch.cuda.Stream()

    def timed(timer, stream) -> tuple[float, float]:
        """The timer's seconds around 0.2 s of GPU work queued on ``stream``, and that work's own seconds."""
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        timer.start()
        with torch.cuda.stream(stream):
            begin.record()
            torch.cuda._sleep(400_000_000)  # clock cycles: ~0.2 s
            end.record()
        timer.stop()
        torch.cuda.synchronize()
        return timer.elapsed(), begin.elapsed_time(end) / 1000

    elapsed, busy = timed(save, copies)
    assert busy > 0.05 and elapsed < 0.25 * busy, (elapsed, busy)
    elapsed, busy = timed(megatrons, copies)
    assert elapsed >= 0.9 * busy, (elapsed, busy)
    elapsed, busy = timed(save, torch.cuda.current_stream())
    assert elapsed >= 0.9 * busy, (elapsed, busy)
