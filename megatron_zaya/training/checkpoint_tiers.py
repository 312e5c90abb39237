"""Background (``--async-save``) and local-tier checkpoint saves: the flags they imply, the combinations refused
before training starts, the per-rank checksums the background writer records, and waiting for writes in flight.

How the tiers behave on faults: ``docs/reliability.md``. The local tier itself: :mod:`.local_tier`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from ..checkpoint import record_written
from .arguments import UsageError

# Megatron turns --async-save off without --use-persistent-ckpt-worker (arguments.py:1740), and its default
# strategy imports NVIDIA's resiliency package; Megatron's own ("mcore") writer needs neither.
ASYNC_FLAGS = ["--use-persistent-ckpt-worker", "--async-strategy", "mcore"]


def implied_flags(argv: list[str]) -> list[str]:
    """Flags placed before the user's (an explicit one wins): ``--async-save`` alone gives a background save."""
    return ASYNC_FLAGS if "--async-save" in argv else []


def _resiliency_package() -> bool:
    import importlib.util

    return importlib.util.find_spec("nvidia_resiliency_ext") is not None


def check_args(args) -> None:
    """Refuse, in one line, checkpoint-tier flags that cannot work (before Megatron sees them)."""
    local = args.non_persistent_ckpt_type == "local"
    if args.async_save and args.ckpt_format != "torch_dist":
        raise UsageError(f"--async-save writes --ckpt-format torch_dist only, not {args.ckpt_format}; drop one of them")
    if args.async_save and args.async_strategy == "nvrx" and not _resiliency_package():
        raise UsageError("--async-strategy nvrx needs NVIDIA's nvidia_resiliency_ext, which is not installed; drop "
                         "the flag (Megatron's own background writer is used)")
    if args.non_persistent_save_interval is not None and args.non_persistent_save_interval < 1:
        raise UsageError(f"--non-persistent-save-interval {args.non_persistent_save_interval}: must be at least 1")
    if args.non_persistent_save_interval and args.non_persistent_ckpt_type is None:
        raise UsageError("--non-persistent-save-interval needs --non-persistent-ckpt-type local (node-local, "
                         "--non-persistent-local-ckpt-dir) or global")
    if args.zaya_local_ckpt_keep < 1:
        raise UsageError(f"--zaya-local-ckpt-keep {args.zaya_local_ckpt_keep}: keep at least 1 local checkpoint")
    if not local:
        return
    if not args.non_persistent_local_ckpt_dir:
        raise UsageError("--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir DIR (node-local "
                         "storage, e.g. an NVMe path or /dev/shm/<run>)")
    if not args.non_persistent_save_interval:
        raise UsageError("--non-persistent-ckpt-type local saves every --non-persistent-save-interval N steps; give N")
    if not args.save:
        raise UsageError("--non-persistent-ckpt-type local needs --save: local checkpoints sit between persistent ones")
    for flag, given in (("--replication", args.replication), ("--use-checkpoint-args", args.use_checkpoint_args),
                        ("--dist-ckpt-optim-fully-reshardable", args.dist_ckpt_optim_fully_reshardable)):
        if given:
            raise UsageError(f"{flag} does not work with --non-persistent-ckpt-type local; drop one of them")
    root = Path(args.non_persistent_local_ckpt_dir)
    probe = root / f".zaya-write-probe-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"\0")
        probe.unlink()
    except OSError as error:
        raise UsageError(f"--non-persistent-local-ckpt-dir {root} is not writable ({error.strerror}); choose a "
                         "writable node-local directory") from error


def write_then_record(write, rank, write_buckets, results_queue) -> None:
    """Megatron's ``torch_dist`` background write (in the writer process), then the sizes and CRC-32 of the
    files this rank wrote, so that the finalization, in the training loop, does not hash them again."""
    write(rank, write_buckets, results_queue)
    record_written([bucket[0] for bucket in write_buckets], rank)


def finish_background_saves(seconds: float) -> bool:
    """Wait up to ``seconds`` for the background saves in flight and finalize them (their tracker and
    checksums move then); True if none is left. Collective: every rank calls it with the same ``seconds``
    (e.g. the rest of a SIGTERM deadline). Past the time nothing more is finalized and the newest finalized
    checkpoint stays the latest."""
    from megatron.training import async_utils, get_args

    if not get_args().async_save:
        return True
    deadline = time.monotonic() + seconds
    while True:
        async_utils.maybe_finalize_async_save(blocking=False)
        done = async_utils.is_empty_async_queue()
        # One answer for every rank: no rank may go on polling (a collective) after another stopped.
        stop = torch.tensor([float(done or time.monotonic() > deadline)], device=torch.cuda.current_device())
        torch.distributed.all_reduce(stop, op=torch.distributed.ReduceOp.MIN)
        if stop.item():
            return done
        time.sleep(0.05)
