"""A rank's checkpoint tensors written to files in one pass: device tensors staged through a reusable host pool
in chunks, each byte checksummed as it is written, never read back.

:func:`write_tensors` writes the raw bytes of a list of tensors, one after the other, into data files of at
most :data:`FILE_BYTES` each (so that a resume checks them in parallel threads), and returns their sizes and
CRC-32 for the checksum record (:func:`~.format.write_checksums`). A host tensor is written from its own
memory. A device tensor is copied chunk by chunk into the :class:`HostPool`'s buffers (pinned, on a stream of
its own) while the previous chunk is written: the device holds no copy of the state, and the host holds two
chunks beyond the files. :func:`read_tensors` reads them back into one host buffer.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import torch

CHUNK_BYTES = 64 << 20
FILE_BYTES = 1 << 30
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


_pool: HostPool | None = None


def host_pool() -> HostPool:
    """The process's pool, made at its first device save."""
    global _pool
    if _pool is None:
        _pool = HostPool()
    return _pool


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a 1-D ``uint8`` view (a contiguous copy first if it is not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


class _DataFiles:
    """Files ``<stem>.000.bin``, ``<stem>.001.bin``, ... of at most ``limit`` bytes, checksummed as written."""

    def __init__(self, directory: Path, stem: str, limit: int):
        self.directory, self.stem, self.limit = directory, stem, limit
        self.table: dict[str, list[int]] = {}
        self.stream = None

    def _next(self) -> None:
        self.close()
        name = f"{self.stem}.{len(self.table):03d}.bin"
        self.table[name] = [0, 0]
        self.name, self.stream = name, (self.directory / name).open("wb")

    def write(self, data: memoryview) -> None:
        data = data.cast("B")
        while len(data):
            if self.stream is None or self.table[self.name][0] == self.limit:
                self._next()
            size, crc = self.table[self.name]
            part = data[: self.limit - size]
            self.stream.write(part)
            self.table[self.name] = [size + len(part), zlib.crc32(part, crc)]
            data = data[len(part):]

    def close(self) -> None:
        if self.stream is not None:
            self.stream.flush()
            os.fsync(self.stream.fileno())  # the checksum record, written after, must not outlive the data
            self.stream.close()
            self.stream = None


def write_tensors(directory: Path, stem: str, tensors: list[torch.Tensor], limit: int = FILE_BYTES,
                  pool: HostPool | None = None) -> tuple[list[tuple[str, tuple[int, ...]]], dict[str, list[int]]]:
    """Write the bytes of ``tensors`` into ``directory/<stem>.NNN.bin``; returns each tensor's dtype and shape,
    and ``{file: [size, crc32]}``. Device tensors go through ``pool`` (the process's pool by default)."""
    files = _DataFiles(Path(directory), stem, limit)
    offsets, _ = _offsets([tensor.numel() * tensor.element_size() for tensor in tensors])
    written = 0
    try:
        for tensor, offset in zip(tensors, offsets, strict=True):
            files.write(memoryview(bytes(offset - written)))
            written = offset + tensor.numel() * tensor.element_size()
            flat = _bytes(tensor)
            if flat.device.type == "cpu":
                if flat.numel():
                    files.write(memoryview(flat.numpy()))
            else:
                (pool or host_pool()).copy_out([flat], files.write)
    finally:
        files.close()
    specs = [(str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)) for tensor in tensors]
    return specs, files.table


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
