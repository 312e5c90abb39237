"""The lock of a --save directory without a training run: a live holder refuses, a stale one (its process gone
on this host, or no heartbeat from another host) is taken over in one line; the command a stopped run prints."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from megatron_zaya.errors import UsageError
from megatron_zaya.checkpoint.resume import resume_command
from megatron_zaya.checkpoint.save_lock import LOCK, SaveDirLock


def _lock_of(tmp_path, **record):
    (tmp_path / LOCK).write_text(json.dumps({"started": "2026-12-01 10:00:00 UTC", **record}) + "\n")


def _acquire(tmp_path):
    lock = SaveDirLock(str(tmp_path), stale_after=300)
    try:
        return lock, lock.acquire()
    except UsageError:
        lock.release()
        raise


def test_a_live_lock_refuses_and_a_stale_one_is_taken_over(tmp_path):
    _lock_of(tmp_path, host="node-7", pid=4242)  # another host, heartbeat now
    with pytest.raises(UsageError, match=rf"--save {tmp_path} is in use by another run \(host node-7, PID 4242, "):
        _acquire(tmp_path)

    old = time.time() - 1000
    os.utime(tmp_path / LOCK, (old, old))  # its heartbeat stopped 1000 s ago
    lock, line = _acquire(tmp_path)
    try:
        assert line.startswith(f"[zaya] took over the lock of --save {tmp_path} from a run that ended without "
                               "releasing it (host node-7, PID 4242, started 2026-12-01 10:00:00 UTC: no heartbeat "
                               "for 1000 s"), line
        mine = json.loads((tmp_path / LOCK).read_text())
        assert (mine["host"], mine["pid"]) == (socket.gethostname(), os.getpid())
    finally:
        lock.release()
    assert not (tmp_path / LOCK).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no staging file left


def test_the_lock_of_an_ended_process_on_this_host_is_taken_over_at_once(tmp_path):
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid(), open(f'/proc/{os.getpid()}/stat')"
                            ".read().rsplit(')', 1)[1].split()[19])"], capture_output=True, text=True, check=True)
    pid, start = ended.stdout.split()
    _lock_of(tmp_path, host=socket.gethostname(), pid=int(pid), process_start=start)
    lock, line = _acquire(tmp_path)
    lock.release()
    assert line.endswith(f"(host {socket.gethostname()}, PID {pid}, started 2026-12-01 10:00:00 UTC: its process is "
                         "gone)"), line

    # A live process of this host with another start time: its PID was reused, the run that took the lock is gone.
    _lock_of(tmp_path, host=socket.gethostname(), pid=os.getppid(), process_start="1")
    lock, line = _acquire(tmp_path)
    lock.release()
    assert line.endswith("its process is gone)"), line


def test_the_command_that_resumes_leaves_out_a_fresh_start():
    base = ["--mock-data", "--save", "ck", "--train-iters", "9"]
    assert resume_command(base, "ck") == "zaya-pretrain --mock-data --save ck --train-iters 9"
    assert resume_command([*base, "--load", "ck"], "ck").endswith("--train-iters 9 --load ck")
    assert resume_command([*base, "--load", "base", "--finetune", "--no-load-optim", "--zaya-overwrite-save"],
                          "ck") == resume_command(base, "ck")
    assert resume_command([*base, "--load=base", "--data-path", "a b"], "ck").endswith("--train-iters 9 "
                                                                                       "--data-path 'a b'")
