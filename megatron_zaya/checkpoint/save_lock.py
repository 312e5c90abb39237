"""One run at a time writes into a ``--save`` directory. ``<save>/zaya.lock`` names the host, the PID and the start
time of the run writing into the directory; its modification time is a heartbeat, refreshed by a thread. It is
created with ``link()``, atomic on NFS and Lustre as on local disks, and its age is measured against the file
server's clock (the modification time of a file just written there), so hosts whose clocks differ agree on it.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from ..errors import UsageError
from ..runtime import is_rank_0

LOCK = "zaya.lock"


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
    if not is_rank_0():
        return
    line = SaveDirLock(save_dir, stale_after).acquire()
    if line:
        print(line, file=sys.stderr, flush=True)
