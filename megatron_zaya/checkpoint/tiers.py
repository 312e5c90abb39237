"""Background (``--async-save``), local-tier and in-memory checkpoint saves: the flags they imply, the combinations
refused before training starts (an in-memory tier larger than the node's free host memory among them), the copies
a background save takes so that training goes on while it is written, and waiting for writes in flight.

How the tiers behave on faults: ``docs/reliability.md``. The local and in-memory tiers: :mod:`.local_tier`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from pathlib import Path

import torch

from ..errors import UsageError
from ..memory_plan import GIB, RESERVE_GIB

# The flags --async-save implies, placed before the user's (an explicit one wins): --async-save alone gives a
# background save. Megatron turns --async-save off without --use-persistent-ckpt-worker (arguments.py:1740), and its
# default strategy imports NVIDIA's resiliency package; Megatron's own ("mcore") writer needs neither.
ASYNC_FLAGS = ["--use-persistent-ckpt-worker", "--async-strategy", "mcore"]


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
    # A local save's copies are waited for only at the next step's finalize_model_grads (staging.py); a step that
    # shares the gradient and parameter buffers zeroes the parameters before that.
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


_headroom: int | None = None  # device memory the steps reserve above what stays allocated between them


def copy_budget() -> float:
    """Device bytes a background save may copy its tensors into: the memory beyond the steps' own peak, less
    the memory planner's reserve (unlimited without a GPU: host tensors are always copied). The steps' peak is
    taken at the first save, before any copy of a save exists; copies of earlier saves still held count as
    used."""
    global _headroom
    if not torch.cuda.is_available():
        return float("inf")
    torch.cuda.ipc_collect()  # copies the writer process has released
    allocated = torch.cuda.memory_allocated()
    if _headroom is None:
        _headroom = torch.cuda.max_memory_reserved() - allocated
    free, _ = torch.cuda.mem_get_info()
    return free + torch.cuda.memory_reserved() - allocated - _headroom - RESERVE_GIB * GIB


def device_copies(tensors: list[torch.Tensor], budget: float) -> tuple[list[torch.Tensor], frozenset[int]]:
    """Copies of a save's ``tensors``, each on its own device, while their bytes fit ``budget``; past it the
    tensors themselves. Training may change a copied tensor as soon as this returns; the writer stages the
    copies to host memory while training goes on. Returns the tensors to save and the indices of the originals
    among them, which the writer stages while training waits (:func:`stage`)."""
    saved, originals = [], set()
    for index, tensor in enumerate(tensors):
        if tensor.nbytes <= budget:
            budget -= tensor.nbytes
            saved.append(tensor.detach().clone())
        else:
            saved.append(tensor)
            originals.add(index)
    if any(tensor.is_cuda for tensor in saved):
        torch.cuda.current_stream().synchronize()  # the writer reads the copies through IPC, on its own stream
    return saved, frozenset(originals)


def take_copies(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], frozenset[int]]:
    """:func:`device_copies` within :func:`copy_budget`, said in one line on rank 0: what was copied and how
    long the loop waited for it, and what is left for the host copy the loop waits for."""
    start = time.perf_counter()
    saved, originals = device_copies(tensors, copy_budget())
    if torch.distributed.get_rank() == 0:
        left = sum(tensors[i].nbytes for i in originals)
        copied = sum(tensor.nbytes for tensor in tensors) - left
        beyond = f"; {left / GIB:.2f} GiB beyond the budget go to host memory while training waits" if left else ""
        print(f"[zaya] background save: {copied / GIB:.2f} GiB copied on the device in "
              f"{time.perf_counter() - start:.2f} s{beyond}", flush=True)
    return saved, originals


def stage(tensors: list, which: frozenset[int] | None = None) -> list:
    """Put host copies in place of ``tensors`` (the list is changed in place, so that no device reference is
    left): the originals at indices ``which``, copied even on the host since training changes them, or, with
    ``which`` None, every tensor still on a device. Originals go to pinned memory, fastest, as the training loop
    waits for them; copies to pageable memory, since the writer has time and host memory is what runs short."""
    pinned = which is not None
    indices = which if pinned else [i for i, tensor in enumerate(tensors) if tensor.device.type != "cpu"]
    for index in indices:
        tensors[index] = tensors[index].to("cpu", non_blocking=pinned, copy=True)
    if pinned and torch.cuda.is_available():
        torch.cuda.synchronize()
    return tensors


def _bucket_tensors(buckets: list) -> list:
    return [tensor for _, _, (_, tensors) in buckets for _, tensor in tensors]


def _set_bucket_tensors(buckets: list, tensors: list) -> list:
    it = iter(tensors)
    for index, (path, key, (raw, items)) in enumerate(buckets):
        buckets[index] = (path, key, (raw, [(item, next(it)) for item, _ in items]))
    return buckets


def stage_buckets(buckets: list, which: frozenset[int] | None = None) -> list:
    """:func:`stage` for the tensors of Megatron's ``torch_dist`` write buckets, in place."""
    return _set_bucket_tensors(buckets, stage(_bucket_tensors(buckets), which))


def background_request(request):
    """A ``torch_dist`` background save (``FileSystemWriterAsync``'s request) that copies its tensors on their
    devices within :func:`copy_budget`, so that the training loop waits only for the host copy of what did not
    fit (and for a previous write still running), then in the writer process stages the copies to host memory
    and writes them."""
    rank, buckets, results_queue = request.async_fn_args
    tensors, originals = take_copies(_bucket_tensors(buckets))
    buckets = _set_bucket_tensors(list(buckets), tensors)
    # Always a preload, even of nothing: the loop waits for the writer to take it, so that at most one save is
    # queued behind a write (a save interval shorter than a write then waits, as without copies).
    return request._replace(async_fn=functools.partial(stage_and_write, request.async_fn),
                            async_fn_args=[rank, buckets, results_queue],
                            preload_fn=functools.partial(stage_buckets, buckets, originals))


def stage_and_write(write, rank, write_buckets, results_queue) -> None:
    """In the background writer: stage the device copies to host memory, then run Megatron's ``torch_dist``
    write (with the ``checkpointing.checksums_while_writing`` patch, :func:`~.format.write_recording_checksums`:
    the files checksummed as they are written, and recorded, so that the finalization, in the training loop,
    does not hash them again)."""
    start = time.perf_counter()
    stage_buckets(write_buckets)
    staged = time.perf_counter()
    write(rank, write_buckets, results_queue)
    if rank == 0:  # what sets the shortest save interval that does not wait for the previous write
        print(f"[zaya] background save written in {time.perf_counter() - start:.1f} s: staged to host memory "
              f"{staged - start:.1f} s, written {time.perf_counter() - staged:.1f} s", flush=True)
