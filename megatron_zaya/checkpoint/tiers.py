"""Background (``--async-save``), local-tier and in-memory checkpoint saves: the flags they imply, the combinations
refused before training starts (an in-memory tier larger than the node's free host memory among them). How a
background save is staged through host memory and written: :mod:`.staging`.

How the tiers behave on faults: ``docs/reliability.md``. The local and in-memory tiers: :mod:`.local_tier`.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ..errors import UsageError
from ..memory_plan import GIB

# The flags --async-save implies, placed before the user's (an explicit one wins): --async-save alone gives a
# background save. Megatron turns --async-save off without --use-persistent-ckpt-worker (arguments.py:1740), and its
# default strategy imports NVIDIA's resiliency package; Megatron's own ("mcore") writer needs neither. The save plan
# kept from the first save (--ckpt-assume-constant-structure) shortens every later save call; the patch
# checkpointing.replan_on_new_structure plans afresh a save whose structure changed.
ASYNC_FLAGS = ["--use-persistent-ckpt-worker", "--async-strategy", "mcore", "--ckpt-assume-constant-structure"]


MEMORY_ROOT = "/dev/shm"


def memory_dir(given: str | None, save: str | None) -> str | None:
    """The in-memory tier's directory: ``--zaya-memory-ckpt-dir``, else one per run under ``/dev/shm`` named
    after ``--save`` (its name and a hash of its path, so that two runs on a node do not collide)."""
    if given or not save:
        return given
    path = os.path.realpath(save)
    return f"{MEMORY_ROOT}/zaya-{os.path.basename(path)}-{hashlib.sha1(path.encode()).hexdigest()[:10]}"


def memory_tier_flags(interval: int | None, given_dir: str | None, save: str | None) -> list[str]:
    """The flags ``--zaya-memory-ckpt-interval`` implies, placed before the user's: the in-memory tier is
    Megatron's local non-persistent checkpoint in shared memory (:mod:`.local_tier`)."""
    directory = memory_dir(given_dir, save)
    if not interval or directory is None:
        return []
    return ["--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", directory,
            "--non-persistent-save-interval", str(interval)]


def _check_memory_tier(args) -> None:
    interval = args.zaya_memory_ckpt_interval
    if interval is None:
        return
    if interval < 1:
        raise UsageError(f"--zaya-memory-ckpt-interval {interval}: must be at least 1")
    if args.zaya_memory_ckpt_keep < 1:
        raise UsageError(f"--zaya-memory-ckpt-keep {args.zaya_memory_ckpt_keep}: keep at least 1 in-memory checkpoint")
    if not args.save:
        raise UsageError("--zaya-memory-ckpt-interval needs --save: in-memory checkpoints sit between persistent ones")
    if not getattr(args, "use_gloo_process_groups", True):
        raise UsageError("--zaya-memory-ckpt-interval copies each rank's part to another node over the data-parallel "
                         "gloo group; drop --disable-gloo-process-groups")
    implied = ("local", memory_dir(args.zaya_memory_ckpt_dir, args.save), interval)
    given = (args.non_persistent_ckpt_type, args.non_persistent_local_ckpt_dir, args.non_persistent_save_interval)
    if given != implied:
        raise UsageError("--zaya-memory-ckpt-interval is Megatron's local non-persistent checkpoint in host memory; "
                         "drop --non-persistent-ckpt-type, --non-persistent-local-ckpt-dir and "
                         "--non-persistent-save-interval, or drop --zaya-memory-ckpt-interval")


def free_host_memory() -> float:
    """Bytes of host memory this node can still give (``MemAvailable``)."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        return float(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def host_memory_available(directory: str) -> float:
    """:func:`free_host_memory`, plus what ``directory`` (the in-memory tier of a run being resumed, which its
    own saves replace) already holds."""
    held = sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file()) if Path(directory).is_dir() else 0
    return free_host_memory() + held


def check_host_memory(args, needed: float) -> None:
    """Refuse an in-memory tier that needs more than this node's free host memory (``needed``: the memory
    planner's bytes per node)."""
    available = host_memory_available(args.non_persistent_local_ckpt_dir)
    if needed > available:
        raise UsageError(f"--zaya-memory-ckpt-interval: the in-memory tier needs {needed / GIB:.1f} GiB of host memory "
                         f"on each node ({args.zaya_memory_ckpt_keep} kept + 1 being written, the copies of "
                         f"another node's parts and the staging pool; --zaya-memory-plan itemizes it), this node has "
                         f"{available / GIB:.1f} GiB free; lower --zaya-memory-ckpt-keep, or spread the state over "
                         "more GPUs")


def _resiliency_package() -> bool:
    import importlib.util

    return importlib.util.find_spec("nvidia_resiliency_ext") is not None


def check_args(args) -> None:
    """Refuse, in one line, checkpoint-tier flags that cannot work (before Megatron sees them)."""
    _check_memory_tier(args)
    local = args.non_persistent_ckpt_type == "local"
    if args.async_save and args.ckpt_format != "torch_dist":
        raise UsageError(f"--async-save writes --ckpt-format torch_dist only, not {args.ckpt_format}; drop one of them")
    if args.async_save and args.async_strategy == "nvrx" and not _resiliency_package():
        raise UsageError("--async-strategy nvrx needs NVIDIA's nvidia_resiliency_ext, which is not installed; drop "
                         "the flag (Megatron's own background writer is used)")
    # A background or local save's copies are waited for only at the next step's finalize_model_grads
    # (staging.py); a step that shares the gradient and parameter buffers zeroes the parameters before that.
    if args.async_save and args.reuse_grad_buf_for_mxfp8_param_ag:
        raise UsageError("--reuse-grad-buf-for-mxfp8-param-ag does not work with --async-save; drop one of them")
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
                        ("--dist-ckpt-optim-fully-reshardable", args.dist_ckpt_optim_fully_reshardable),
                        ("--reuse-grad-buf-for-mxfp8-param-ag", args.reuse_grad_buf_for_mxfp8_param_ag)):
        if given:
            raise UsageError(f"{flag} does not work with --non-persistent-ckpt-type local; drop one of them")
    root = Path(args.non_persistent_local_ckpt_dir)
    probe = root / f".zaya-write-probe-{os.getpid()}"
    existed = root.is_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"\0")
        probe.unlink()
        if not existed:  # made again by the first save; a run refused later leaves nothing
            root.rmdir()
    except OSError as error:
        raise UsageError(f"--non-persistent-local-ckpt-dir {root} is not writable ({error.strerror}); choose a "
                         "writable node-local directory") from error
