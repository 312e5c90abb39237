"""Run a function on N CPU processes joined by a gloo process group: ``run_ranks(worker, world, tmp_path)``.

Ranks are forked from a fork server (not from pytest, whose process may hold a process group or thread pools
that a plain fork would inherit half-alive). The server imports the heavy modules once, so a launch takes
about a second; workers must be module-level functions (they travel by reference).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Imported once by the fork server. set_forkserver_preload only acts until the server starts, so the first
# run_ranks call of a pytest process fixes the list (plus that caller's module); later modules import lazily.
FORKSERVER_PRELOAD = ["torch", "megatron_zaya.optim", "megatron.core.dist_checkpointing", "megatron.core.distributed",
                      "megatron.training.training", "megatron_zaya.model", "megatron_zaya.optim.megatron",
                      "megatron_zaya.patches.cpu", "megatron_zaya.training.balancing", __name__]  # fmt: skip


def _entry(rank, world, out_dir, worker, args):
    torch.set_num_threads(1)
    # A rendezvous file in this call's own directory, not a TCP port: a port picked free here can be taken by a
    # test running beside this one (pytest-xdist) before rank 0's store listens on it, and a rank that joins the
    # other test's store hangs both.
    dist.init_process_group("gloo", init_method=f"file://{Path(out_dir) / 'rendezvous'}", rank=rank,
                            world_size=world)
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
    mp.start_processes(_entry, args=(world, str(out_dir), worker, args), nprocs=world, start_method="forkserver")
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
