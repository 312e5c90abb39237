"""The on-disk layout of a Megatron ``torch_dist`` checkpoint directory, its tracker, and the checksums
megatron-zaya records in each step directory.

A checkpoint directory holds ``latest_checkpointed_iteration.txt`` (:data:`TRACKER`: an iteration number or
``release``) and one sub-directory per saved step (``iter_0000100`` or ``release``) written by
``megatron.core.dist_checkpointing``. Every step directory saved by megatron-zaya (training or conversion) also
holds ``zaya_checksums.json`` (:data:`CHECKSUMS`): the size and CRC-32 of each of its files, written after all of
them and before the tracker names the step (:func:`write_checksums`); :mod:`.integrity` checks the files against it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import zlib
from pathlib import Path

from ..errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
CHECKSUMS = "zaya_checksums.json"
_CHUNK = 16 << 20
_THREADS = 16  # zlib.crc32 releases the GIL: threads hash files in parallel, bounded by the disk


def read_tracker(ckpt_dir: str | os.PathLike) -> str | None:
    """The tracker's marker (``"release"`` or an iteration number), or None if missing, empty or garbage."""
    try:
        marker = (Path(ckpt_dir) / TRACKER).read_text(errors="replace").strip()
    except OSError:
        return None
    return marker if marker == "release" or marker.isdigit() else None


def step_name(marker: str | int) -> str:
    """``release`` or ``iter_0000100``: the directory name of a tracker marker."""
    return "release" if marker == "release" else f"iter_{int(marker):07d}"


def describe_latest_checkpoint(save_dir: str | None) -> str:
    """'ckpt/iter_0000009 (iteration 9)', or why there is none."""
    if not save_dir:
        return "none (no --save directory)"
    marker = read_tracker(save_dir)
    if marker is None:
        return f"none yet in {save_dir}"
    return f"{Path(save_dir) / step_name(marker)} (iteration {marker})"


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as stream:
        while chunk := stream.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_crcs(paths: list[Path]) -> list[int]:
    """The CRC-32 of each of ``paths``, hashed in parallel threads."""
    if len(paths) <= 1:
        return [_crc32(p) for p in paths]
    with concurrent.futures.ThreadPoolExecutor(min(_THREADS, len(paths))) as pool:
        return list(pool.map(_crc32, paths))


def record_written(paths: list[str | os.PathLike], rank: int, known: dict[str, list[int]] | None = None) -> None:
    """Record the size and CRC-32 of the files ``paths`` that ``rank`` just wrote (all in one step directory),
    for :func:`write_checksums` to take instead of reading them again (:func:`write_recording_checksums`). Files
    checksummed as they were written (``known``: ``{path: [size, crc32]}``, :func:`checksums_while_writing`)
    with the size they have are not read; the others are."""
    if not paths:
        return
    known = known or {}
    sizes = {p: Path(p).stat().st_size for p in map(os.fspath, paths)}
    unknown = [p for p, size in sizes.items() if known.get(p, [None])[0] != size]
    crcs = dict(zip(unknown, file_crcs([Path(p) for p in unknown]), strict=True))
    table = {Path(p).name: [size, crcs[p] if p in crcs else known[p][1]] for p, size in sizes.items()}
    _write_atomically(Path(paths[0]).parent / f".{CHECKSUMS}.rank-{rank:05d}", {"algorithm": "crc32", "files": table})


_recording: dict[str, list[int]] | None = None  # the table of checksums_while_writing, while one is on


@contextlib.contextmanager
def checksums_while_writing():
    """Within it, the files this process opens with :func:`open_checksummed` for writing (``wb``) are CRC-32'd as
    their bytes are written; yields ``{path: [size, crc32]}``, filled as they are closed."""
    global _recording
    _recording = table = {}
    try:
        yield table
    finally:
        _recording = None


def write_recording_checksums(write, rank: int, write_buckets: list, results_queue) -> None:
    """Megatron's ``torch_dist`` write (``write``, ``FileSystemWriterAsync.write_preloaded_data_multithread`` with
    its first arguments bound), each file CRC-32'd as its bytes are written (:func:`checksums_while_writing`; the
    ``checkpointing.checksums_while_writing`` patch opens the files through :func:`open_checksummed`), then the
    sizes and CRC-32 recorded (:func:`record_written`), so that :func:`write_checksums` does not read the files."""
    with checksums_while_writing() as checksummed:
        write(rank, write_buckets, results_queue)
    record_written([bucket[0] for bucket in write_buckets], rank, checksummed)


def open_checksummed(file, mode: str = "r", *args, **kwargs):
    """``open``; within :func:`checksums_while_writing`, a file opened ``wb`` comes wrapped in a
    :class:`ChecksummedFile`."""
    stream = open(file, mode, *args, **kwargs)
    if _recording is None or mode != "wb":
        return stream
    return ChecksummedFile(stream, os.fspath(file), _recording)


class ChecksummedFile:
    """A file being written whose size and CRC-32 go into ``table[path]`` when it is closed after a write in
    order; one that seeks is left out (it is hashed after, as before)."""

    def __init__(self, stream, path: str, table: dict[str, list[int]]):
        self._stream, self._path, self._table = stream, path, table
        self._size, self._crc = 0, 0

    def write(self, data) -> int:
        written = self._stream.write(data)  # a buffered file writes every byte or raises
        view = memoryview(data)
        self._size += view.nbytes
        try:
            self._crc = None if self._crc is None else zlib.crc32(view, self._crc)
        except (TypeError, BufferError, ValueError):  # not one contiguous buffer: hashed after
            self._crc = None
        return written

    def seek(self, *args) -> int:
        self._crc = None
        return self._stream.seek(*args)

    def close(self) -> None:
        self._stream.close()
        if self._crc is not None:
            self._table[self._path] = [self._size, self._crc]

    def __enter__(self):
        return self

    def __exit__(self, kind, *rest) -> None:
        if kind is not None:
            self._crc = None
        self.close()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def write_checksum_table(path: str | os.PathLike, table: dict[str, list[int]]) -> None:
    """Write ``{file: [size, crc32]}`` as the :data:`CHECKSUMS` of the directory ``path``, atomically."""
    _write_atomically(Path(path) / CHECKSUMS, {"algorithm": "crc32", "files": table})


def _write_atomically(target: Path, record: dict) -> None:
    staging = target.with_name(f".{CHECKSUMS}.tmp-{os.getpid()}")
    with staging.open("w") as stream:
        json.dump(record, stream)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(staging, target)


def check_written(path: str | os.PathLike) -> None:
    """Raise :class:`CheckpointError` unless every byte range that the ``.metadata`` of the ``torch_dist`` step
    directory ``path`` records lies in a file that exists and is that long (a step without one passes)."""
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(path)
    if not (path / ".metadata").is_file():
        return
    ends: dict[str, int] = {}
    for info in FileSystemReader(str(path)).read_metadata().storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        size = (path / name).stat().st_size if (path / name).is_file() else None
        if size is None or size < end:
            raise CheckpointError(f"{path / name} {'is missing' if size is None else f'has {size} bytes'}, but the "
                                  f"checkpoint's .metadata places data up to byte {end} in it: the save is incomplete")


def write_checksums(path: str | os.PathLike, known: dict[str, list[int]] | None = None) -> None:
    """Record the size and CRC-32 of every file of the step directory ``path`` in :data:`CHECKSUMS`, written
    last and atomically (staged, fsynced, renamed), so that its presence means every file was complete.
    Files the writers recorded (:func:`record_written`, or ``known``: ``{file: [size, crc32]}`` checksummed as
    they were written) with the size they still have are not read again."""
    path = Path(path)
    files = sorted(f for f in path.rglob("*") if f.is_file() and f.name != CHECKSUMS and not f.name.startswith(
        f".{CHECKSUMS}"))
    records = sorted(path.glob(f".{CHECKSUMS}.rank-*"))
    known = dict(known or {})
    for record in records:
        known.update(recorded_files(path, record.name) or {})
    names = [str(f.relative_to(path)) for f in files]
    sizes = [f.stat().st_size for f in files]
    crcs = [known[n][1] if known.get(n, [None])[0] == size else None for n, size in zip(names, sizes)]
    hashed = iter(file_crcs([f for f, crc in zip(files, crcs) if crc is None]))
    table = {n: [size, next(hashed) if crc is None else crc] for n, size, crc in zip(names, sizes, crcs)}
    write_checksum_table(path, table)
    for record in records:
        record.unlink()


def recorded_files(path: str | os.PathLike, name: str = CHECKSUMS) -> dict[str, list[int]] | None:
    """``{file: [size, crc32]}`` recorded at save, None without a readable record (older or foreign saves)."""
    try:
        record = json.loads((Path(path) / name).read_text())
        return {str(file): [int(size), int(crc)] for file, (size, crc) in record["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def publish_permissions(path: str | os.PathLike) -> None:
    """Give ``path`` and the directories below it the permissions ``mkdir`` would (``mkdtemp`` makes them
    private to the user), before they are renamed into place."""
    umask = os.umask(0)
    os.umask(umask)
    path = Path(path)
    for directory in [path, *(p for p in path.rglob("*") if p.is_dir())]:
        directory.chmod(0o777 & ~umask)


class AtomicTracker:
    """The tracker file ``path`` being written: staged next to it and renamed over it on a clean close (never seen
    half-written), once the step it names is checked complete (:func:`check_written`) and its checksums are
    written (:func:`write_checksums`)."""

    def __init__(self, path: str):
        self.path = path
        self.staging = f"{path}.tmp-{os.getpid()}"
        self.file = open(self.staging, "w")

    def write(self, text: str) -> int:
        return self.file.write(text)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        if exc_type is not None:
            os.unlink(self.staging)
            return False
        marker = Path(self.staging).read_text().strip()
        step = Path(self.path).parent / step_name(marker) if marker.isdigit() or marker == "release" else None
        if step is not None and step.is_dir():
            try:
                check_written(step)
            except Exception:
                os.unlink(self.staging)
                raise
            write_checksums(step)
        os.replace(self.staging, self.path)
        directory = os.open(os.path.dirname(self.path) or ".", os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        return False
