"""The --save directory: a run resumes from it without --load, starts afresh into it only with
--zaya-overwrite-save, and holds a lock on it that a second run respects (docs/reliability.md)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

from zaya_cli import QUICK, losses, pretrain


def _line(output: str, start: str) -> str:
    found = [line for line in output.splitlines() if line.startswith(start)]
    assert len(found) == 1, output[-3000:]
    return found[0]


def test_a_run_resumes_from_its_save_directory_and_starts_afresh_only_when_asked(tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = QUICK + ["--train-iters", "6", "--save", str(ckpt), "--save-interval", "3", "--exit-interval", "3"]
    first = pretrain(flags, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(losses(first.stdout)) == [1, 2, 3]
    stopped = _line(first.stdout, "[zaya] stopped early")
    assert f"the last checkpoint: {ckpt}/iter_0000003 (iteration 3); resume with: zaya-pretrain " in stopped, stopped

    # The command printed, as printed: it resumes at step 4 and says so.
    command = shlex.split(stopped.split("resume with: ", 1)[1])
    assert command[1:] == flags
    resumed = pretrain(command[1:], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _line(resumed.stdout, "[zaya] resuming") == (f"[zaya] resuming from the checkpoint in --save {ckpt} "
                                                       "(iteration 3); --zaya-overwrite-save starts afresh instead")
    after = losses(resumed.stdout)
    assert sorted(after) == [4, 5, 6]

    # Afresh into the same directory, asked for: the old checkpoints go, and the run repeats the first one's steps
    # and, past step 3, the resumed one's (the reference of both: one uninterrupted run).
    fresh = pretrain(flags[:-2] + ["--zaya-overwrite-save"], cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert _line(fresh.stdout, "[zaya] --zaya-overwrite-save") == (
        f"[zaya] --zaya-overwrite-save: deleted the 2 checkpoint(s) in {ckpt} (the newest: iteration 6); starting "
        "afresh")
    whole = losses(fresh.stdout)
    assert {i: whole[i] for i in (1, 2, 3)} == losses(first.stdout)
    assert {i: whole[i] for i in (4, 5, 6)} == after
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "6"


def test_a_second_run_into_a_save_directory_is_refused_while_the_first_holds_its_lock(tmp_path):
    """Two real processes: the second, into the first's --save, stops in one line and the first trains on; the
    lock names the first and its heartbeat moves. Ctrl-C (SIGINT to the job's process group, as a terminal sends
    it) then saves like SIGTERM, exits 0 without a traceback, and releases the lock."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "first.log"
    flags = QUICK + ["--train-iters", "400", "--save", str(ckpt), "--save-interval", "1000",
                     "--zaya-save-lock-stale-after", "2"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("WORLD_SIZE", None)
    with log.open("w") as out:
        first = subprocess.Popen([sys.executable, "-m", "megatron_zaya.pretrain", *flags], cwd=tmp_path, stdout=out,
                                 stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.time() + 300
        while 3 not in losses(log.read_text()) and time.time() < deadline:
            assert first.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        lock = ckpt / "zaya.lock"
        holder = json.loads(lock.read_text())
        assert (holder["host"], holder["pid"]) == (socket.gethostname(), first.pid)
        beat = lock.stat().st_mtime
        time.sleep(1)  # a heartbeat every 0.2 s
        assert lock.stat().st_mtime > beat

        second = pretrain(QUICK + ["--train-iters", "400", "--save", str(ckpt)], cwd=tmp_path)
        assert second.returncode == 2, second.stderr[-3000:]
        assert "Traceback" not in second.stderr
        error = second.stderr.strip().splitlines()[-1]
        assert error.startswith(f"zaya-pretrain: error: --save {ckpt} is in use by another run (host "
                                f"{socket.gethostname()}, PID {first.pid}, started {holder['started']};"), error
        assert first.poll() is None and json.loads(lock.read_text()) == holder

        os.killpg(first.pid, signal.SIGINT)
        assert first.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    output = log.read_text()
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    trained = max(losses(output))
    assert int((ckpt / "latest_checkpointed_iteration.txt").read_text()) == trained
    assert not lock.exists()
