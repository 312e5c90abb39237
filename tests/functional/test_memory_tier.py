"""The in-memory tier in real runs: two "nodes" of one rank each (started as torchrun starts ranks, with
``LOCAL_WORLD_SIZE`` 1; each with its own memory directory, as two hosts' ``/dev/shm``) train with in-memory
checkpoints every 3 steps and a persistent one every 5; node 1 is SIGKILLed after step 7 (once its part of 6
has reached node 0, sent by its tier's thread while training went on), the job ends, node 1 is replaced
(its memory directory gone) and the persistent checkpoint is damaged. The relaunch resumes from the in-memory
checkpoint, rank 1's part from its copy on node 0, without reading the persistent checkpoint, and repeats the
killed run's losses bit for bit. Each launch allocates the tier's host pool at start-up, for a part of the size the
ranks then write."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

from zaya_cli import KILLED_RUN, losses

from megatron_zaya.checkpoint import CHECKSUMS
from megatron_zaya.runtime import free_master_port

FLAGS = KILLED_RUN + ["--save", "ck", "--save-interval", "5", "--zaya-memory-ckpt-interval", "3"]


def _launch(directory, name: str, extra: list[str]) -> list[subprocess.Popen]:
    """The two ranks of one job, each in its own session (a node), logging to ``<name><node>.log``."""
    port = free_master_port()  # below the ephemeral range, out of reach of the port-0 binds of tests beside it
    procs = []
    for node in (0, 1):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "WORLD_SIZE": "2", "RANK": str(node), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
        with (directory / f"{name}{node}.log").open("w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "megatron_zaya.pretrain", *FLAGS, "--zaya-memory-ckpt-dir", f"mem{node}",
                 *extra], cwd=directory, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env))
    return procs


def _kill_node(rank: subprocess.Popen) -> None:
    """SIGKILL a node: its rank and the rank's helpers."""
    os.killpg(rank.pid, signal.SIGKILL)
    rank.wait()


def test_a_node_killed_and_replaced_resumes_from_the_copy_on_its_peer(tmp_path):
    procs = _launch(tmp_path, "killed", [])
    log = tmp_path / "killed1.log"  # the last rank prints the iteration lines
    copied = tmp_path / "mem0" / "iter_0000006" / "rank_00001" / CHECKSUMS  # sent by node 1's tier thread
    deadline = time.time() + 300
    while ((max(losses(log.read_text()), default=0) < 7 or not copied.exists()) and procs[1].poll() is None
           and time.time() < deadline):
        time.sleep(0.005)
    _kill_node(procs[1])  # node 1 fails
    _kill_node(procs[0])  # and the scheduler ends the job
    killed = losses(log.read_text())
    assert max(killed) >= 7, log.read_text()[-3000:]

    saved = sorted(int(p.parent.parent.name[5:]) for p in (tmp_path / "mem0").glob(f"iter_*/rank_00001/{CHECKSUMS}"))
    start = saved[-1]  # rank 1's newest part, as node 0 keeps it
    assert start == 6 < max(killed), (saved, killed)
    # The pool allocated at start-up, before the first save (1 GiB: the part's one file), for the part written:
    # rank 0's estimate (an even share of the state) against the bytes of both ranks' parts (rank 1's copy here).
    output = (tmp_path / "killed0.log").read_text()
    planned = re.search(r"\[zaya\] host pool of local-tier saves allocated at start-up in [0-9.]+ s: 1 buffer\(s\) "
                        r"of 1024 MiB, for a part of ([0-9.]+) MiB", output)
    assert planned and planned.start() < output.index("saving checkpoint at iteration"), output[-3000:]
    written = sum(f.stat().st_size for f in (tmp_path / "mem0").glob("iter_0000006/rank_*/tensors.*.bin"))
    assert abs(2 * float(planned.group(1)) * 2**20 - written) < 0.001 * written, (planned.group(1), written)
    shutil.rmtree(tmp_path / "mem1")  # the replacement node's memory is empty
    shard = tmp_path / "ck" / "iter_0000005" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[1000:1008] = bytes(b ^ 0xFF for b in data[1000:1008])
    shard.write_bytes(bytes(data))

    procs = _launch(tmp_path, "resumed", ["--exit-interval", str(start + 2)])
    assert [p.wait(timeout=300) for p in procs] == [0, 0], (tmp_path / "resumed0.log").read_text()[-3000:]
    output = (tmp_path / "resumed0.log").read_text()
    assert "[zaya] host pool of local-tier saves allocated at start-up" in output, output[-3000:]
    assert (f"[zaya] local checkpoint mem0/iter_{start:07d}: the part of rank 1 taken from its copy on another node"
            in output), output[-3000:]
    assert f"[zaya] resuming from the local checkpoint mem0/iter_{start:07d} (the persistent one in --load: 5)" \
        in output, output[-3000:]
    assert "differs from its checksum" not in output  # the damaged persistent checkpoint was not read
    relaunch = losses((tmp_path / "resumed1.log").read_text())
    assert min(relaunch) == start + 1 and max(relaunch) == start + 2, relaunch
    both = [i for i in relaunch if i in killed]
    assert both and all(relaunch[i] == killed[i] for i in both), (relaunch, killed)
