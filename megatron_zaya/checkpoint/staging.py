"""A rank's checkpoint tensors staged to host memory while training goes on, then written to files in one pass,
each byte checksummed as it is written, never read back.

A :class:`Snapshot` of a save's tensors is taken in the training loop (an event on the training stream);
:meth:`Snapshot.write`, in a thread of its own, copies them chunk by chunk into the process's
:class:`HostPool` (pinned on a GPU, reused by every save) on a CUDA stream of its own, beside the next step's
forward and backward, while writer threads write the data files from the pool as their chunks land (the raw
bytes of each tensor one after the other, each aligned to :data:`ALIGN`, in files of at most
:data:`FILE_BYTES`, :data:`THREADS` at a time), and returns their sizes and CRC-32 for the checksum record
(:func:`~.format.write_checksums`). Without CUDA the same code copies with plain host copies.
:func:`read_tensors` reads them back onto their devices in one pass, each file checksummed as it is read. A
background ``torch_dist`` save (:func:`background_request`) takes the same copies into a pool of one buffer that
holds the whole part (:func:`whole_pool`) and hands the tensors, landed, to Megatron's writer
(:meth:`Snapshot.copy_to_host`).

When the copies must have landed: training writes the saved tensors (weights, master weights, optimizer
state, the routers' balancing biases) only from the end of the next step's backward on, in
``finalize_model_grads`` (the balancing step) and the optimizer step after it. The forward and backward
before read them and write activations and gradients, which a checkpoint does not hold (a step that zeroes
the parameters with the gradients, ``--reuse-grad-buf-for-mxfp8-param-ag``, is refused by :mod:`.tiers`).
So the training loop calls :func:`wait_for_copies` at the start of ``finalize_model_grads`` (the
``checkpointing.local_tier`` patch): it waits until every copy is queued, and makes the training stream wait
for the last one, a wait of the device, not of the host (on the CPU, until the copies are done). A pool the
size of the part, rather than a few buffers recycled as their chunks reach the files, is what lets the copies
end without waiting for the files: that wait is bounded by the device-to-host bandwidth, never by the disk
(a part larger than the pool, see :class:`HostPool`, also waits for the writes of the files it reuses).
The device holds no copy of the state: contiguous tensors are copied as they are, and a non-contiguous one is
made contiguous a slice of rows at a time (at most :data:`CHUNK_BYTES`, or one row), on the copy stream, each
slice reusing the memory of the one before.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import functools
import itertools
import math
import os
import threading
import time
import zlib
from pathlib import Path
from typing import NamedTuple

import torch

from .tiers import free_host_memory

CHUNK_BYTES = 32 << 20
FILE_BYTES = 1 << 30
THREADS = 8
READ_CHUNK_BYTES = 8 << 20  # a chunk read back is checksummed and sent on while still in the CPU's cache
ALIGN = 64  # each tensor starts at a multiple of this in the data, so that it is read back as a view


def _offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Where each tensor of ``sizes`` bytes starts in the data, and the data's length."""
    offsets, end = [], 0
    for size in sizes:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + size
    return offsets, end


class HostPool:
    """Host memory for a part's data, buffers of ``segment`` bytes, one per data file, up to ``most`` (data file
    k is staged in buffer k mod ``most``), pinned when CUDA is available (allocating them takes seconds, once),
    reused by every save; and the CUDA stream the copies into them run on. The buffers are allocated at start-up
    in a thread of their own (:meth:`allocate`), or else by the first save that needs them, in the save call. By
    default ``most`` holds a part in half of the node's free host memory shared by its ranks
    (``LOCAL_WORLD_SIZE``); a larger part waits for its earlier files to be written."""

    def __init__(self, segment: int = FILE_BYTES, most: int | None = None):
        share = free_host_memory() / 2 / int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.segment, self.most = segment, most or max(2, int(share // segment))
        self.segments: list[torch.Tensor] = []
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self._allocating: threading.Thread | None = None

    def allocate(self, count: int, done=None) -> None:
        """Allocate the first ``count`` buffers (at most ``most``) in a thread of its own, which then calls
        ``done(seconds)``; :meth:`take` waits for it."""
        def allocate() -> None:
            start = time.perf_counter()
            if self.stream is not None:
                torch.cuda.set_device(self.stream.device)  # a new thread starts on device 0
            while len(self.segments) < min(count, self.most):
                self.segments.append(self._buffer())
            if done is not None:
                done(time.perf_counter() - start)

        self._allocating = threading.Thread(target=allocate, name="zaya-host-pool", daemon=True)
        self._allocating.start()

    def take(self, index: int) -> torch.Tensor:
        """The buffer of data file ``index``, once the allocation at start-up is done (allocated here when it is not
        one of its buffers)."""
        if self._allocating is not None:
            self._allocating.join()
        while len(self.segments) <= index % self.most:
            self.segments.append(self._buffer())
        return self.segments[index % self.most]

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.segment, dtype=torch.uint8, pin_memory=self.stream is not None)


_pools: dict[int, HostPool] = {}  # the process's pools by segment size; one save at a time uses a pool
_unfenced: list["Snapshot"] = []  # snapshots whose copies the training loop has not waited for yet
_whole: list[HostPool] = []  # the pool of :func:`whole_pool`


def whole_pool(tensors: list[torch.Tensor]) -> HostPool:
    """The process's pool for the saves whose tensors must stay whole in host memory until they are written (a
    background ``torch_dist`` save: Megatron's writer takes host tensors): one buffer that holds the data of
    ``tensors``, allocated at start-up (:func:`allocate_pool`) or by the first save, and reused by every later one
    (a larger save replaces it)."""
    end = _offsets([t.numel() * t.element_size() for t in tensors])[1]
    if not _whole or _whole[0].segment < end:
        _whole[:] = [HostPool(max(end, 1), most=1)]
    return _whole[0]


def allocate_pool(part_bytes: float, whole: bool) -> None:
    """At start-up: allocate, in a thread, the pool that the saves of a part of about ``part_bytes`` bytes will
    take, so that the first save does not pay it (a save that comes before the thread is done waits for it):
    the local tier's buffers of :data:`FILE_BYTES` (at most its ``most``), or with ``whole`` a background save's
    one buffer (:func:`whole_pool`), rounded up to whole :data:`FILE_BYTES`, so that a part a little larger than
    the estimate still fits. A save that needs more allocates the rest. Rank 0 says when it is done."""
    count = max(1, math.ceil(part_bytes / FILE_BYTES))
    if whole:
        _whole[:] = [pool := HostPool(count * FILE_BYTES, most=1)]
    else:
        pool = _pools.setdefault(FILE_BYTES, HostPool(FILE_BYTES))

    def done(seconds: float) -> None:
        if torch.distributed.is_initialized() and torch.distributed.get_rank() == 0:
            print(f"[zaya] host pool of {'background' if whole else 'local-tier'} saves allocated at start-up in "
                  f"{seconds:.2f} s: {len(pool.segments)} buffer(s) of {pool.segment / 2**20:.0f} MiB"
                  f"{' pinned' if pool.stream is not None else ''}, for a part of {part_bytes / 2**20:.2f} MiB (the "
                  "memory plan's)", flush=True)

    pool.allocate(1 if whole else count, done)


def wait_for_copies() -> None:
    """Called by the training loop before it next writes the tensors of a save (see the module docstring):
    returns once every copy of the snapshots taken is queued, the training stream waiting for the last."""
    while _unfenced:
        _unfenced.pop().wait_copied()


def _flat_pieces(tensor: torch.Tensor, chunk: int):
    """(first byte in the tensor, those bytes as a 1-D ``uint8`` tensor) in order, at most ``chunk`` bytes each
    (or one row of a non-contiguous tensor, which is made contiguous a slice of rows at a time)."""
    tensor = tensor.detach()
    if tensor.numel() == 0:
        return
    if tensor.is_contiguous():
        flat = tensor.reshape(-1).view(torch.uint8)
        for start in range(0, flat.numel(), chunk):
            yield start, flat[start:start + chunk]
        return
    row = tensor[0].numel() * tensor.element_size()
    rows = max(1, chunk // row)
    for first in range(0, tensor.shape[0], rows):
        yield first * row, tensor[first:first + rows].contiguous().reshape(-1).view(torch.uint8)


class Snapshot:
    """The bytes of a save's ``tensors`` as they are when it is made (in the training loop), copied into a
    :class:`HostPool` and written from it by :meth:`write` (in another thread); the training loop calls
    :func:`wait_for_copies` before it changes them."""

    def __init__(self, tensors: list[torch.Tensor], limit: int = FILE_BYTES, chunk: int = CHUNK_BYTES,
                 pool: HostPool | None = None):
        self.tensors = tensors
        self.specs = [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in tensors]
        self.devices = [t.device.type for t in tensors]  # where a resume puts them back (:func:`read_tensors`)
        self.sizes = [t.numel() * t.element_size() for t in tensors]
        self.offsets, self.end = _offsets(self.sizes)
        self.chunk = chunk
        self.pool = pool or (_pools[limit] if limit in _pools else _pools.setdefault(limit, HostPool(limit)))
        self.files = -(-self.end // self.pool.segment)
        for index in range(min(self.files, self.pool.most)):  # here, in the save (under the watchdog's pause for
            self.pool.take(index)  # saves), not in the copies the next step waits for: pinning takes seconds
        self.ready = None
        if any(t.is_cuda for t in tensors):  # what the copies wait for: the work that produced the tensors
            self.ready = torch.cuda.Event()
            self.ready.record()
        self._copied = threading.Event()
        self._last = None  # the copy stream's event after the latest device copy
        self._progress = threading.Condition()
        self._landed: list[tuple[int, object]] = []  # (data bytes copied, the copy stream's event after them)
        self._stopped = False  # the copies ended, all queued or not
        self._written = [threading.Event() for _ in range(self.files)]  # a file written: its buffer is free
        _unfenced.append(self)

    def _copy(self) -> None:
        """Queue every chunk's copy into the pool (on the CPU: copy it), in data order; zero the gaps."""
        stream, position = self.pool.stream, 0
        try:
            if self.ready is not None:
                torch.cuda.set_device(stream.device)  # a new thread starts on device 0
                stream.wait_event(self.ready)
            for tensor, offset, size in zip(self.tensors, self.offsets, self.sizes):
                self._fill(torch.zeros(offset - position, dtype=torch.uint8), position)
                with torch.cuda.stream(stream) if tensor.is_cuda else contextlib.nullcontext():
                    for first, piece in _flat_pieces(tensor, self.chunk):
                        self._fill(piece, offset + first)
                position = offset + size
            self._mark(self.end)
        finally:
            self.end_copies()

    def end_copies(self) -> None:
        """The copies end here, all queued or not: the training loop's wait and the writers return. Whatever owns
        the snapshot calls it last, so that a save failing before its copies (a directory it cannot make) does
        not leave the training loop waiting for them."""
        with self._progress:
            self._stopped = True
            self._progress.notify_all()
        self._copied.set()

    def _mark(self, position: int) -> None:
        with self._progress:
            self._landed.append((position, self._last))
            self._progress.notify_all()

    def _fill(self, piece: torch.Tensor, at: int) -> None:
        """Copy the bytes ``piece`` into the pool at data position ``at``, split where a data file ends (each
        part marked landed on its own, so that a file's writer never waits for a later file's buffer); into a
        buffer still holding an earlier file once that file is written."""
        done, segment = 0, self.pool.segment
        while done < piece.numel():
            index, start = divmod(at + done, segment)
            if index >= self.pool.most:
                self._written[index - self.pool.most].wait()
            length = min(piece.numel() - done, segment - start)
            self.pool.take(index)[start:start + length].copy_(piece[done:done + length], non_blocking=piece.is_cuda)
            done += length
            if piece.is_cuda:
                self._last = torch.cuda.Event()
                self._last.record(self.pool.stream)
            self._mark(at + done)

    def wait_copied(self) -> None:
        """In the training loop: return once every copy is queued, the training stream waiting for the last."""
        self._copied.wait()
        if self._last is not None:
            torch.cuda.current_stream().wait_event(self._last)

    def _wait_landed(self, position: int) -> None:
        """Until the data bytes before ``position`` are in the pool."""
        with self._progress:
            self._progress.wait_for(lambda: self._stopped or self._landed and self._landed[-1][0] >= position)
            if not self._landed or self._landed[-1][0] < position:
                raise RuntimeError("the checkpoint's copy to host memory failed")
            event = self._landed[bisect.bisect_left(self._landed, position, key=lambda mark: mark[0])][1]
        if event is not None:
            event.synchronize()

    def copy_to_host(self) -> list[torch.Tensor]:
        """Copy the tensors into the pool (in this thread) and return them once landed, in the pool (a pool of one
        buffer that holds them all, :func:`whole_pool`), each a tensor of its own storage: ``torch.save``, which
        Megatron's writer calls for each tensor, writes a view's whole storage. The tensors are released once
        copied."""
        try:
            if self.files > 1:
                raise ValueError(f"{self.end} bytes of tensors do not fit one buffer of {self.pool.segment} bytes")
            self._copy()
        finally:
            if self._last is not None:
                self._last.synchronize()
            self.tensors = []
            self.end_copies()
        self._wait_landed(self.end)
        data = memoryview(self.pool.take(0).numpy())
        return [torch.frombuffer(data, dtype=torch.uint8, count=size, offset=start).view(getattr(torch, dtype))
                .view(shape) if size else torch.empty(shape, dtype=getattr(torch, dtype))
                for (dtype, shape), size, start in zip(self.specs, self.sizes, self.offsets, strict=True)]

    def write(self, directory: Path, stem: str, threads: int = THREADS) -> dict[str, list[int]]:
        """Copy the tensors into the pool (in this thread) while the files ``directory/<stem>.NNN.bin`` are
        written from it as their chunks land, a file per thread at a time (writes and CRC-32 release the GIL),
        each fsynced; returns ``{file: [size, crc32]}``. The tensors are released once copied."""
        segment = self.pool.segment
        names = [f"{stem}.{i:03d}.bin" for i in range(self.files)]

        def write_file(index: int) -> list[int]:
            low, high = index * segment, min(self.end, (index + 1) * segment)
            crc, data = 0, memoryview(self.pool.take(index).numpy())
            try:
                with (Path(directory) / names[index]).open("wb") as stream:
                    for start in range(low, high, self.chunk):
                        stop = min(high, start + self.chunk)
                        self._wait_landed(stop)
                        view = data[start - low:stop - low]
                        stream.write(view)
                        crc = zlib.crc32(view, crc)
                    stream.flush()
                    os.fsync(stream.fileno())  # the checksum record, written after, must not outlive the data
            finally:
                self._written[index].set()
            return [high - low, crc]

        with concurrent.futures.ThreadPoolExecutor(max(1, min(threads, self.files))) as workers:
            written = workers.map(write_file, range(self.files))  # started now, waiting for their chunks
            try:
                self._copy()
            finally:
                if self._last is not None:  # every copy done: the tensors may be freed or reused
                    self._last.synchronize()
                self.tensors = []
            return dict(zip(names, written, strict=True))


class ReadBack(NamedTuple):
    """What :func:`read_tensors` read: the tensors, each file's CRC-32, and the seconds its threads spent, summed
    over them, reading the files, checksumming and copying to a device (``reads``, ``checksums``, ``copies``)."""

    tensors: list[torch.Tensor]
    crcs: list[int]
    seconds: dict[str, float]


def spec_bytes(specs: list[tuple[str, tuple[int, ...]]]) -> list[int]:
    """The bytes of each tensor of ``specs`` (:attr:`Snapshot.specs`: dtype name, shape)."""
    return [torch.Size(shape).numel() * getattr(torch, dtype).itemsize for dtype, shape in specs]


def read_tensors(paths: list[Path], specs: list[tuple[str, tuple[int, ...]]], devices: list[str] | None = None,
                 threads: int = THREADS, chunk: int = READ_CHUNK_BYTES) -> ReadBack:
    """The tensors :class:`Snapshot` wrote into the files ``paths`` (in order), each on its device of ``devices``
    (``"cuda"``, ``"cpu"``; default: the host), and the CRC-32 of each file, computed as it is read: every byte is
    read once, a chunk at a time, and checksummed (and sent to its device) while still in the CPU's cache,
    ``threads`` files at a time (reads, CRC-32 and copies release the GIL). When every device is ``"cpu"`` the
    tensors are views of one buffer the files are read into; otherwise each is allocated on its own (a view would
    keep the whole part alive as long as any tensor of it) and filled from the file's chunks, on a GPU from two
    pinned ones taking turns, on a CUDA stream of the file's."""
    paths = [Path(p) for p in paths]
    sizes = spec_bytes(specs)
    offsets, end = _offsets(sizes)
    starts = list(itertools.accumulate((p.stat().st_size for p in paths), initial=0))
    if starts[-1] != end:
        raise ValueError(f"{len(paths)} files of tensors hold {starts[-1]} bytes, the tensors {end}")
    devices = devices or ["cpu"] * len(specs)
    on_host = all(device == "cpu" for device in devices)
    if on_host:
        buffer = torch.empty(end, dtype=torch.uint8)
        tensors = [buffer[start:start + size].view(getattr(torch, dtype)).view(shape)
                   for (dtype, shape), size, start in zip(specs, sizes, offsets, strict=True)]
        view = memoryview(buffer.numpy())
    else:
        tensors = [torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                   for (dtype, shape), device in zip(specs, devices, strict=True)]
        flats = [t.reshape(-1).view(torch.uint8) for t in tensors]
    cuda = next((t.device for t in tensors if t.is_cuda), None)
    if cuda is not None:  # what the copies wait for: the memory's earlier work on the allocating stream
        allocated = torch.cuda.Event()
        allocated.record()

    def scatter(data: torch.Tensor, at: int) -> None:
        """Copy the data bytes ``data``, from position ``at``, into the tensors they belong to."""
        for i in range(max(0, bisect.bisect_right(offsets, at) - 1), len(specs)):
            if offsets[i] >= at + data.numel():
                break
            low, high = max(at, offsets[i]), min(at + data.numel(), offsets[i] + sizes[i])
            if low < high:
                flats[i][low - offsets[i]:high - offsets[i]].copy_(data[low - at:high - at], non_blocking=True)

    def read_file(index: int) -> tuple[int, list[float]]:
        """Read file ``index`` into place: its CRC-32, and the seconds spent reading, checksumming, copying."""
        low, high = starts[index], starts[index + 1]
        crc, spent, stream = 0, [0.0, 0.0, 0.0], None
        if cuda is not None:
            torch.cuda.set_device(cuda)  # a new thread starts on device 0
            stream = torch.cuda.Stream(cuda)
            stream.wait_event(allocated)
        pinned = cuda is not None
        slots = [] if on_host else [torch.empty(min(chunk, high - low), dtype=torch.uint8, pin_memory=pinned)
                                    for _ in range(1 + pinned)]
        landed = [None] * len(slots)  # the copy stream's event after each slot's copies
        with paths[index].open("rb", buffering=0) as file, \
                torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for k, start in enumerate(range(low, high, chunk)):
                length, clock = min(high - start, chunk), time.perf_counter()
                if on_host:
                    into = view[start:start + length]
                else:
                    slot = k % len(slots)
                    if landed[slot] is not None:  # the slot's previous copies are done
                        landed[slot].synchronize()
                    into = memoryview(slots[slot].numpy())[:length]
                waited, done = time.perf_counter(), 0
                while done < length and (got := file.readinto(into[done:])):
                    done += got
                if done < length:
                    raise ValueError(f"{paths[index]} ended after {start - low + done} of its {high - low} bytes")
                read = time.perf_counter()
                crc = zlib.crc32(into, crc)
                hashed = time.perf_counter()
                if not on_host:
                    scatter(slots[slot][:length], start)
                    landed[slot] = stream.record_event() if stream is not None else None
                spent[0] += read - waited
                spent[1] += hashed - read
                spent[2] += waited - clock + time.perf_counter() - hashed
        if stream is not None:
            clock = time.perf_counter()
            stream.synchronize()
            spent[2] += time.perf_counter() - clock
        return crc, spent

    with concurrent.futures.ThreadPoolExecutor(max(1, min(threads, len(paths)))) as workers:
        results = list(workers.map(read_file, range(len(paths))))
    spent = [sum(s[i] for _, s in results) for i in range(3)]
    return ReadBack(tensors, [crc for crc, _ in results], dict(zip(("reads", "checksums", "copies"), spent)))


_writing: list[threading.Thread] = []  # the thread writing the background save in flight


def background_request(request):
    """A ``torch_dist`` background save (``FileSystemWriterAsync``'s request) staged through host memory: its
    tensors are copied into the process's pool (:func:`whole_pool`, pinned on a GPU) by a thread of
    the training process, on a CUDA stream of its own beside the next step (the training loop waits for those
    copies only before it changes the tensors, :func:`wait_for_copies`), and Megatron's writer, in the
    same thread, writes the files from the pool (:func:`write_from_host`). No copy of the state is made on the
    device. Megatron's writer process gets a request that waits until that thread is done
    (:func:`wait_until_written`), so that Megatron finalizes the save (``.metadata``, tracker) after its files.

    The write runs in the training process, not in Megatron's writer process (``--use-persistent-ckpt-worker``,
    started with ``forkserver``): handing it the pool would need the pool in shared memory and pinned there,
    registered with CUDA, and the writer would wait for copies that run in another process; and Megatron's
    writer process does not have the patches of this process (the files checksummed as written). The write
    releases the GIL (file writes, CRC-32), as the local tier's does. A save first waits for the write before
    it: the two share the pool."""
    rank, buckets, results_queue = request.async_fn_args
    for thread in _writing:
        thread.join()
    tensors = [tensor for _, _, (_, items) in buckets for _, tensor in items]
    snapshot = Snapshot(tensors, pool=whole_pool(tensors))  # from here the next step waits for its copies
    written = torch.zeros(1, dtype=torch.int8).share_memory_()
    _writing[:] = [threading.Thread(target=write_from_host, name="zaya-background-save", daemon=True,
                                    args=(snapshot, request.async_fn, rank, list(buckets), results_queue, written))]
    _writing[0].start()
    return request._replace(async_fn=functools.partial(wait_until_written, written), async_fn_args=(),
                            preload_fn=None)


def write_from_host(snapshot: Snapshot, write, rank: int, write_buckets: list, results_queue, written) -> None:
    """The background save's thread: copy the tensors into the pool, then run Megatron's ``torch_dist`` write
    (``write``, with the ``checkpointing.checksums_while_writing`` patch
    :func:`~.format.write_recording_checksums`) from the pool; set ``written`` when done, failed or not (a failed
    copy is handed to Megatron's finalization, which raises it on every rank, as a failed write). Megatron's write
    pauses the process's automatic garbage collection while it runs; ``--zaya-gc-interval`` (on by default) has
    it off anyway."""
    try:
        start = time.perf_counter()
        try:
            tensors = iter(snapshot.copy_to_host())
        except Exception as error:
            results_queue.put(error)
            return
        staged = time.perf_counter()
        host = [(name, key, (raw, [(item, next(tensors)) for item, _ in items]))
                for name, key, (raw, items) in write_buckets]
        write(rank, host, results_queue)
        if rank == 0:  # what sets the shortest save interval that does not wait for the previous write
            count = sum(len(raw) + len(items) for _, _, (raw, items) in host)
            print(f"[zaya] background save written in {time.perf_counter() - start:.1f} s: copied to host memory "
                  f"{staged - start:.1f} s, written {time.perf_counter() - staged:.1f} s ({count} items in "
                  f"{len(host)} files)", flush=True)
    finally:
        written[0] = 1


def wait_until_written(written: torch.Tensor) -> None:
    """In Megatron's writer process: return once the training process's thread has written the save (or
    failed), so that Megatron reports it done, and finalizes it, only then."""
    while not written.item():
        time.sleep(0.02)
