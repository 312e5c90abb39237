"""Saves that cannot or did not succeed: a ``--save`` directory that cannot take the next checkpoint is refused
before training starts (exit 2), and a save that fails while training becomes one line naming the cause and the
previous checkpoint, which stays intact (exit 3).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from ..errors import TrainingFault, UsageError
from .format import describe_latest_checkpoint, read_tracker, step_name

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # no space left, or the user's quota used up
NO_ROOM = {**dict.fromkeys(DISK_FULL, "the disk is full"), errno.EFBIG: "a file may grow no larger"}


def _want_of_room(error: OSError) -> str | None:
    """'the disk is full, ENOSPC: No space left on device' and the like, for an error of :data:`NO_ROOM`; else None."""
    if error.errno not in NO_ROOM:
        return None
    return f"{NO_ROOM[error.errno]}, {errno.errorcode[error.errno]}: {error.strerror}"


def _probe_for_room(directory: str | os.PathLike) -> str | None:
    """What :func:`_want_of_room` says if a 1 MiB write in ``directory`` fails for want of room (a full disk, a quota, a
    file-size limit), else None. (A failed checkpoint write reaches us without its errno: Megatron's writer reports
    only the error's type.)"""
    probe = Path(directory) / f".zaya-space-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"\0" * (1 << 20))
    except OSError as error:
        return _want_of_room(error)
    finally:
        probe.unlink(missing_ok=True)
    return None


def write_failure(error: BaseException, directory: str | os.PathLike) -> str:
    """Why a write into ``directory`` failed as ``error`` (a checkpoint save's ``CheckpointException`` too), in a
    few words: want of room as such, else the error's type and last line."""
    failures = getattr(error, "failures", None)  # CheckpointException: {rank: (exception, traceback)}
    cause = next(iter(failures.values()))[0] if failures else error
    room = (_want_of_room(cause) if isinstance(cause, OSError) else None) or _probe_for_room(directory)
    return room or f"{type(cause).__name__}: {str(cause).strip().splitlines()[-1] if str(cause).strip() else ''}"


def check_save_dir(save_dir: str) -> None:
    """Raise :class:`UsageError` if ``save_dir`` cannot take the next checkpoint: not creatable or writable,
    or with less free space than the latest checkpoint in it occupies."""
    root = Path(save_dir)
    probe = root / f".zaya-write-probe-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"\0" * 4096)
        probe.unlink()
    except OSError as error:
        if error.errno in DISK_FULL:
            raise UsageError(f"--save {save_dir}: the disk is full ({errno.errorcode[error.errno]}: {error.strerror}); "
                             "free space or choose another --save") from error
        raise UsageError(f"--save {save_dir} is not writable ({error.strerror}: {error.filename}); "
                            "choose a writable directory or fix its permissions") from error
    marker = read_tracker(root)
    if marker is not None:
        latest = root / step_name(marker)
        needed = sum(f.stat().st_size for f in latest.rglob("*") if f.is_file()) if latest.is_dir() else 0
        free = shutil.disk_usage(root).free
        if free < needed:
            raise UsageError(f"--save {save_dir} has {free / 2**30:.2f} GiB free but its last checkpoint "
                                f"({latest.name}) takes {needed / 2**30:.2f} GiB; free space or choose another --save")


def failed_save(error: BaseException, iteration: int, save_dir: str) -> TrainingFault:
    """The fault that a failed save of ``iteration`` into ``save_dir`` raised as ``error`` stops the run with: its
    cause (a full disk as such), the save directory and the previous checkpoint. The failed save's step directory,
    which the tracker does not name, is removed: on a full disk it is what fills it."""
    summary = write_failure(error, save_dir)
    partial = Path(save_dir) / step_name(iteration)
    if read_tracker(save_dir) != str(iteration) and partial.is_dir():
        shutil.rmtree(partial, ignore_errors=True)  # every failing rank: whichever comes first
        summary += f"; its partial {partial.name} is removed"
    return TrainingFault(
        f"saving the checkpoint of iteration {iteration} to {save_dir} failed ({summary}); free space or "
        f"fix the directory, then resume with --load {save_dir} from the previous checkpoint, which is "
        f"intact: {describe_latest_checkpoint(save_dir)}")
