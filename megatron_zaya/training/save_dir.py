"""The ``--save`` directory of a run: resuming from it by default, replacing it only when asked, and a lock that
keeps two runs from writing into it at once.

* A run resumes where it saves: without ``--load``, zaya-pretrain loads from ``--save`` (Megatron starts afresh
  from a directory without a checkpoint). :func:`check_save_and_load` refuses a run that would start afresh into
  a directory holding a checkpoint (another ``--load``, ``--finetune``) unless ``--zaya-overwrite-save`` is
  given, and a ``--load`` that does not exist.
* :class:`SaveDirLock`: ``<save>/zaya.lock`` names the host, the PID and the start time of the run writing into
  the directory; its modification time is a heartbeat, refreshed by a thread. It is created with ``link()``,
  atomic on NFS and Lustre as on local disks, and its age is measured against the file server's clock (the
  modification time of a file just written there), so hosts whose clocks differ agree on it.
"""

from __future__ import annotations

import atexit
import json
import os
import shlex
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

from ..checkpoint import CHECKSUMS, TRACKER, read_tracker
from ..errors import UsageError

LOCK = "zaya.lock"
OVERWRITE_FLAG = "--zaya-overwrite-save"
# Flags of a run that starts afresh from another checkpoint; a resume from --save leaves them out.
_FRESH_START_FLAGS = (OVERWRITE_FLAG, "--finetune", "--no-load-optim", "--no-load-rng")


def _same(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def held_checkpoint(save_dir: str) -> str | None:
    """What ``save_dir`` holds that a resume would load ('iteration 8'), or None for no complete checkpoint."""
    root = Path(save_dir)
    marker = read_tracker(root)
    if marker is not None:
        return "release" if marker == "release" else f"iteration {marker}"
    saved = [p for p in root.glob("iter_*") if (p / CHECKSUMS).is_file()]  # a damaged or garbage tracker
    return f"iteration {int(max(saved).name[5:])}" if saved else None


def check_save_and_load(args, argv: list[str]) -> str | None:
    """Refuse a ``--load`` that does not exist, and a fresh start into a ``--save`` that holds a checkpoint
    (unless ``--zaya-overwrite-save``). Returns the line to print when the run resumes from ``--save`` without
    ``--load`` being given."""
    if args.load and not Path(args.load).exists() and not _same(args.load, args.save):
        raise UsageError(f"--load {args.load}: no such directory (relative paths start at {os.getcwd()}); give the "
                         "checkpoint directory, or drop --load to start afresh")
    held = held_checkpoint(args.save) if args.save else None
    if held is None:
        return None
    resumes = _same(args.load, args.save) and not args.finetune
    if args.zaya_overwrite_save:
        if _same(args.load, args.save):
            raise UsageError(f"{OVERWRITE_FLAG} with --load {args.load}, the --save directory, would delete the "
                             "checkpoint it loads; save into another directory")
        return None
    if not resumes:
        reason = "--finetune restarts at iteration 0" if args.finetune else f"it loads --load {args.load}"
        undo = "--finetune" if args.finetune else "--load"
        raise UsageError(f"--save {args.save} holds a checkpoint ({held}) of another run, which this run would replace "
                         f"({reason}); to resume that run drop {undo}, to keep it choose another --save, to replace "
                         f"it add {OVERWRITE_FLAG}")
    if "--load" not in [a.split("=", 1)[0] for a in argv]:
        return (f"[zaya] resuming from the checkpoint in --save {args.save} ({held}); {OVERWRITE_FLAG} starts "
                "afresh instead")
    return None


def remove_checkpoints(save_dir: str) -> str | None:
    """``--zaya-overwrite-save``: delete the checkpoints in ``save_dir`` (tracker first, so that a kill midway
    leaves no checkpoint named); returns the line saying what went, or None if there was none."""
    held = held_checkpoint(save_dir)
    if held is None:
        return None
    root = Path(save_dir)
    (root / TRACKER).unlink(missing_ok=True)
    steps = sorted(p for p in [*root.glob("iter_*"), root / "release"] if p.is_dir())
    for path in steps:
        shutil.rmtree(path)
    return (f"[zaya] {OVERWRITE_FLAG}: deleted the {len(steps)} checkpoint(s) in {save_dir} (the newest: {held}); "
            "starting afresh")


def resume_command(argv: list[str], save: str | None) -> str:
    """The command that resumes this run from ``save``: this one, without the flags of a fresh start."""
    kept, skip = [], False
    for i, arg in enumerate(argv):
        name = arg.split("=", 1)[0]
        if skip:
            skip = False
        elif name in _FRESH_START_FLAGS:
            continue
        elif name == "--load" and not _same(arg.split("=", 1)[1] if "=" in arg else
                                            (argv[i + 1] if i + 1 < len(argv) else None), save):
            skip = "=" not in arg
        else:
            kept.append(arg)
    launcher = "zaya-torchrun ... -m megatron_zaya.pretrain" if "TORCHELASTIC_RUN_ID" in os.environ else "zaya-pretrain"
    return " ".join([launcher, *map(shlex.quote, kept)])


# ---------------------------------------------------------------------------------------------------- the lock
def _process_start(pid: int) -> str | None:
    """The kernel's start time of process ``pid`` (clock ticks since boot), None if it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


class SaveDirLock:
    """``<save>/zaya.lock``: one run at a time writes into a ``--save`` directory (on global rank 0)."""

    def __init__(self, save_dir: str, stale_after: float):
        self.path = Path(save_dir) / LOCK
        self.stale_after = stale_after
        self.record = {"host": socket.gethostname(), "pid": os.getpid(), "process_start": _process_start(os.getpid()),
                       "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        self._stop = threading.Event()

    def acquire(self) -> str | None:
        """Take the lock, or raise :class:`UsageError` if a live run holds it; returns the line that says a stale
        lock was taken over, if one was."""
        mine = self.path.with_name(f".{LOCK}.{self.record['host']}.{os.getpid()}")
        mine.write_text(json.dumps(self.record) + "\n")
        taken_over = None
        try:
            for _ in range(3):  # another run may take the lock, or take over the same stale one, meanwhile
                try:
                    os.link(mine, self.path)
                    break
                except FileExistsError:
                    pass
                holder, why_stale = self._holder()
                if holder is None:
                    continue  # released meanwhile
                if why_stale is None:
                    raise UsageError(
                        f"--save {self.path.parent} is in use by another run (host {holder.get('host')}, PID "
                        f"{holder.get('pid')}, started {holder.get('started')}; {self.path}); wait for it to end or "
                        f"choose another --save (a lock without a heartbeat for {self.stale_after:g} s is taken over)")
                stale = self.path.with_name(f".{LOCK}.stale.{os.getpid()}")
                try:
                    os.rename(self.path, stale)  # only one taker gets it
                except FileNotFoundError:
                    continue
                stale.unlink()
                taken_over = (f"[zaya] took over the lock of --save {self.path.parent} from a run that ended without "
                              f"releasing it (host {holder.get('host')}, PID {holder.get('pid')}, started "
                              f"{holder.get('started')}: {why_stale})")
            else:
                raise UsageError(f"--save {self.path.parent}: could not take {self.path}, which other runs keep "
                                 "taking; choose another --save")
        finally:
            mine.unlink()
        atexit.register(self.release)
        threading.Thread(target=self._beat, name="zaya-save-lock-heartbeat", daemon=True).start()
        return taken_over

    def _holder(self) -> tuple[dict | None, str | None]:
        """The record of the run holding the lock (None if there is no lock), and why it is stale (None: live)."""
        try:
            text, beat = self.path.read_text(), self.path.stat().st_mtime
        except FileNotFoundError:
            return None, None
        try:
            holder = json.loads(text)
        except ValueError:
            holder = {}
        if holder.get("host") == self.record["host"]:
            start = _process_start(int(holder.get("pid", 0)))
            if start is None or start != holder.get("process_start"):
                return holder, "its process is gone"
        age = self._server_now() - beat
        if age > self.stale_after:
            return holder, f"no heartbeat for {age:.0f} s"
        return holder, None

    def _server_now(self) -> float:
        """The file server's time: the modification time of a file written now next to the lock."""
        probe = self.path.with_name(f".{LOCK}.clock.{os.getpid()}")
        probe.write_bytes(b"")
        try:
            return probe.stat().st_mtime
        finally:
            probe.unlink()

    def _beat(self) -> None:
        while not self._stop.wait(self.stale_after / 10):
            try:
                os.utime(self.path)
            except OSError:
                pass  # the directory went away; the next acquire decides

    def release(self) -> None:
        """Remove the lock if it is still this run's."""
        self._stop.set()
        try:
            holder = json.loads(self.path.read_text())
            if (holder.get("host"), holder.get("pid")) == (self.record["host"], self.record["pid"]):
                self.path.unlink()
        except (OSError, ValueError):
            pass


def lock_save_dir(save_dir: str, stale_after: float) -> None:
    """On global rank 0: take the lock of ``save_dir`` for this process's life (see :class:`SaveDirLock`)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    line = SaveDirLock(save_dir, stale_after).acquire()
    if line:
        print(line, file=sys.stderr, flush=True)
