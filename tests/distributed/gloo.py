"""Run a function on N CPU processes joined by a gloo process group: ``run_ranks(worker, world, tmp_path)``.

Ranks are forked from a fork server (not from pytest, whose process may hold a process group or thread pools
that a plain fork would inherit half-alive). The server imports the heavy modules once, so a launch takes
about a second; workers must be module-level functions (they travel by reference).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Imported once by the fork server. set_forkserver_preload only acts until the server starts, so the first
# run_ranks call of a pytest process fixes the list (plus that caller's module); later modules import lazily.
FORKSERVER_PRELOAD = ["torch", "megatron_zaya.optim", "megatron.core.dist_checkpointing", "megatron.core.distributed",
                      "megatron.training.training", "megatron_zaya.model", "megatron_zaya.optim.megatron",
                      "megatron_zaya.patches.cpu", "megatron_zaya.training.balancing", __name__]  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank, world, port, out_dir, worker, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = worker(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def run_ranks(worker, world: int, tmp_path: Path, *args) -> list:
    """``worker(rank, world, *args)`` on ``world`` forked gloo ranks; returns each rank's result (in rank order)."""
    out_dir = tmp_path / f"{worker.__name__}-{world}"
    out_dir.mkdir(parents=True)
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(FORKSERVER_PRELOAD + [worker.__module__])
    mp.start_processes(_entry, args=(world, free_port(), str(out_dir), worker, args), nprocs=world,
                       start_method="forkserver")  # fmt: skip
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
