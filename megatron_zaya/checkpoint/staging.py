"""A rank's checkpoint tensors written to files in one pass: device tensors staged through reusable host pools in
chunks, each byte checksummed as it is written, never read back.

:func:`write_tensors` lays the raw bytes of a list of tensors out one after the other (each aligned to
:data:`ALIGN`) and writes them as data files of at most :data:`FILE_BYTES`, :data:`THREADS` files at a time,
and returns their sizes and CRC-32 for the checksum record (:func:`~.format.write_checksums`); the files also
let a resume check them in parallel. A host tensor is written from its own memory. A device tensor is copied
chunk by chunk into a :class:`HostPool`'s buffers (pinned, on a stream of its own) while the previous chunk is
written: the device holds no copy of the state, and the host two chunks per writing thread beyond the files.
:func:`read_tensors` reads them back into one host buffer.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import zlib
from pathlib import Path

import torch

CHUNK_BYTES = 32 << 20
FILE_BYTES = 1 << 30
THREADS = 8
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
    """``slots`` host buffers of ``chunk`` bytes, reused by every save of the process; pinned when CUDA is
    available, so that a chunk's device-to-host copy runs on the pool's stream while the previous chunk is
    written."""

    def __init__(self, chunk: int = CHUNK_BYTES, slots: int = 2):
        cuda = torch.cuda.is_available()
        self.chunk = chunk
        self.buffers = [torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda) for _ in range(slots)]
        self.stream = torch.cuda.Stream() if cuda else None

    def copy_out(self, flats: list[torch.Tensor], write) -> None:
        """``write(memoryview)`` the bytes of the 1-D ``uint8`` tensors ``flats`` in order, in chunks through the
        pool: the copy of chunk k+1 is queued before chunk k is written."""
        pending = None  # (event, buffer view) of the chunk copied, not yet written
        index = 0
        for flat in flats:
            if self.stream is not None and flat.is_cuda:
                self.stream.wait_stream(torch.cuda.current_stream(flat.device))  # the step that produced it
            for start in range(0, flat.numel(), self.chunk):
                piece = flat[start:start + self.chunk]
                view = self.buffers[index % len(self.buffers)][: piece.numel()]
                index += 1
                event = None
                if self.stream is not None and piece.is_cuda:
                    with torch.cuda.stream(self.stream):
                        view.copy_(piece, non_blocking=True)
                        event = torch.cuda.Event()
                        event.record(self.stream)
                else:
                    view.copy_(piece)
                if pending is not None:
                    _write_chunk(*pending, write)
                pending = (event, view)
        if pending is not None:
            _write_chunk(*pending, write)


def _write_chunk(event, view: torch.Tensor, write) -> None:
    if event is not None:
        event.synchronize()
    write(memoryview(view.numpy()))


_pools: queue.SimpleQueue = queue.SimpleQueue()  # the process's pools, one per writing thread, reused by every save


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a 1-D ``uint8`` view (a contiguous copy first if it is not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _pieces(sizes: list[int], offsets: list[int], low: int, high: int) -> list[tuple[int, int, int, int]]:
    """(tensor, first byte in it, bytes, position in the data) of the tensor bytes in the data's [low, high)."""
    return [(i, max(start, low) - start, min(start + size, high) - max(start, low), max(start, low))
            for i, (size, start) in enumerate(zip(sizes, offsets)) if start < high and start + size > low]


def write_tensors(directory: Path, stem: str, tensors: list[torch.Tensor], limit: int = FILE_BYTES,
                  threads: int = THREADS) -> tuple[list[tuple[str, tuple[int, ...]]], dict[str, list[int]]]:
    """Write the bytes of ``tensors`` into ``directory/<stem>.NNN.bin``, a file per thread at a time (writes and
    CRC-32 release the GIL); returns each tensor's dtype and shape, and ``{file: [size, crc32]}``. Device tensors
    go through a :class:`HostPool` per thread."""
    sizes = [tensor.numel() * tensor.element_size() for tensor in tensors]
    offsets, end = _offsets(sizes)
    flats = [_bytes(tensor) for tensor in tensors]
    if any(flat.is_cuda for flat in flats):  # the writing threads' streams cannot wait on this thread's
        torch.cuda.current_stream().synchronize()
    names = [f"{stem}.{i:03d}.bin" for i in range(-(-end // limit))]

    def write_file(index: int) -> list[int]:
        low, high = index * limit, min(end, (index + 1) * limit)
        crc, position = 0, low

        def write(view: memoryview) -> None:
            nonlocal crc
            stream.write(view)
            crc = zlib.crc32(view, crc)

        with (Path(directory) / names[index]).open("wb") as stream:
            for tensor, first, length, at in _pieces(sizes, offsets, low, high):
                write(memoryview(bytes(at - position)))  # alignment
                piece = flats[tensor][first:first + length]
                if piece.device.type == "cpu":
                    write(memoryview(piece.numpy()))
                else:
                    try:
                        pool = _pools.get_nowait()
                    except queue.Empty:
                        pool = HostPool()
                    try:
                        pool.copy_out([piece], write)
                    finally:
                        _pools.put(pool)
                position = at + length
            write(memoryview(bytes(high - position)))
            stream.flush()
            os.fsync(stream.fileno())  # the checksum record, written after, must not outlive the data
        return [high - low, crc]

    with concurrent.futures.ThreadPoolExecutor(max(1, min(threads, len(names)))) as workers:
        table = dict(zip(names, workers.map(write_file, range(len(names))), strict=True))
    specs = [(str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)) for tensor in tensors]
    return specs, table


def read_tensors(directory: Path, stem: str, specs: list[tuple[str, tuple[int, ...]]]) -> list[torch.Tensor]:
    """The tensors :func:`write_tensors` wrote, as views of one host buffer filled from the files in order."""
    sizes = [torch.Size(shape).numel() * getattr(torch, dtype).itemsize for dtype, shape in specs]
    offsets, end = _offsets(sizes)
    buffer = torch.empty(end, dtype=torch.uint8)
    view, offset = memoryview(buffer.numpy()), 0
    for path in sorted(Path(directory).glob(f"{stem}.*.bin")):
        with path.open("rb") as stream:
            while got := stream.readinto(view[offset:]):
                offset += got
    if offset != buffer.numel():
        raise ValueError(f"{directory}: {stem} files hold {offset} bytes, the tensors {buffer.numel()}")
    return [buffer[start:start + size].view(getattr(torch, dtype)).view(shape)
            for (dtype, shape), size, start in zip(specs, sizes, offsets, strict=True)]
