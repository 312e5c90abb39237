"""ZAYA1's local checkpoint tier: each rank writes its own shards to node-local storage (NVMe, ``/dev/shm``); and
the in-memory tier, the same tier in host memory with copies on another node.

``--non-persistent-ckpt-type local --non-persistent-local-ckpt-dir DIR --non-persistent-save-interval N`` saves
every N steps, between the persistent saves of ``--save-interval``. ``--zaya-memory-ckpt-interval N`` is that
tier in shared memory (``/dev/shm``, which outlives the training processes; :mod:`.tiers` sets the flags),
keeping ``--zaya-memory-ckpt-keep`` parts, each also copied to a rank on another node (:mod:`.peer_copy`).
Megatron builds what a rank holds (``MCoreTensorAwareStateDict``: the common state, this rank's tensor shards;
with the default ``--non-persistent-local-ckpt-algo fully_parallel`` a replicated shard is kept by one
data-parallel rank and exchanged on load) and hands it to the ``local_checkpoint_manager`` of its
checkpointing context: an instance of :class:`LocalTier`, installed by the ``checkpointing.local_tier`` patch
in place of NVIDIA's resiliency package. On disk::

    DIR/iter_0000040/rank_00003/tensors.000.bin      this rank's tensor bytes, 1 GiB per file (:mod:`.staging`)
                                state.pt             the rest (torch.save), each tensor's dtype, shape, device
                                layout.json          world size, parallel sizes and rank that wrote it
                                zaya_checksums.json  sizes and CRC-32 of them all, written last and atomically

A save returns at once: a thread of the tier copies the tensors into a host pool beside the next step (pinned,
on a stream of its own on a GPU; the training loop waits for those copies before it changes the tensors,
:mod:`.staging`), writes them, checksummed as they are written (only the small files are hashed after), and
sends the part to its keeper. A rank's part is complete when its ``zaya_checksums.json`` exists; an
iteration can be resumed when every rank of the same layout holds an intact part, or its keeper an intact
copy, which the rank then receives. A resume reads each byte of the part it takes once: the data files are
checked against their checksums as they are read onto the tensors' devices (:func:`read_part`). Each rank keeps
its last K complete parts (and copies). No file is shared between ranks, so nothing here needs a shared
filesystem.
"""

from __future__ import annotations

import copy
import datetime
import functools
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

from ..errors import UsageError
from ..runtime import on_any_rank
from . import peer_copy
from .format import CHECKSUMS, TRACKER, file_crcs, read_tracker, recorded_files, step_name, write_checksums
from .integrity import damage
from .staging import ReadBack, Snapshot, read_tensors, spec_bytes

STATE = "state.pt"
LAYOUT = "layout.json"
TENSORS = "tensors"
_loading = -1  # the local iteration a resume loads (set by find_latest), for the persistent tier to skip


def rank_dir(root: str | os.PathLike, iteration: int, rank: int) -> Path:
    return Path(root) / step_name(iteration) / f"rank_{rank:05d}"


def current_layout() -> dict[str, int]:
    """What a local checkpoint depends on: the world size, the parallel sizes and this rank."""
    from megatron.core import parallel_state as mpu

    return {
        "world_size": torch.distributed.get_world_size(), "rank": torch.distributed.get_rank(),
        "tensor": mpu.get_tensor_model_parallel_world_size(), "pipeline": mpu.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline": mpu.get_virtual_pipeline_model_parallel_world_size() or 1,
        "context": mpu.get_context_parallel_world_size(), "expert": mpu.get_expert_model_parallel_world_size(),
        "expert_tensor": mpu.get_expert_tensor_parallel_world_size(),
        "data": mpu.get_data_parallel_world_size(with_context_parallel=True),
    }


def write_part(path: str, snapshot: Snapshot, state, layout: dict[str, int]) -> None:
    """Write a rank's part (in the tier's thread): its tensors' bytes, copied to host memory from ``snapshot``
    first and checksummed as written, the rest of the state (``state``, its tensors popped), the layout, then
    the checksums, last and atomically. A part of the same iteration left by an earlier run is removed first."""
    part = Path(path)
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    written = snapshot.write(part, TENSORS)
    _synced(part / STATE, lambda stream: torch.save({"state": state, "tensors": snapshot.specs,
                                                     "devices": snapshot.devices}, stream))
    _synced(part / LAYOUT, lambda stream: stream.write(json.dumps(layout).encode()))
    write_checksums(part, written)


def read_part(part: Path) -> tuple[object | None, list[str], ReadBack | None]:
    """A part read once, every file compared with its checksum at save: the small files first, then the data
    files as they are read onto the tensors' devices (:func:`~.staging.read_tensors`). Returns the state, its
    tensors in place, and the read; or None and what is wrong (the lines of :func:`~.integrity.damage`)."""
    recorded = recorded_files(part)
    if recorded is None:
        return None, [f"its {CHECKSUMS} is unreadable"], None
    data = sorted(name for name in recorded if name.startswith(f"{TENSORS}."))
    problems = damage(part, [name for name in recorded if name not in data], recorded)
    saved = None if problems else torch.load(part / STATE, map_location="cpu", weights_only=False)
    read = []

    devices = saved and _devices_to_read_onto(part, saved["tensors"], saved.get("devices"))

    def read_data(paths: list[Path]) -> list[int]:  # the data files of their recorded sizes
        if saved is None or len(paths) < len(data):  # the tensors or their files are amiss: checksums only
            return file_crcs(paths)
        read.append(read_tensors(paths, saved["tensors"], devices))
        return read[0].crcs

    problems += damage(part, data, recorded, read_data)
    if problems:
        return None, problems, None
    saved["state"].insert_tensors(read[0].tensors)
    return saved["state"], [], read[0]


def _devices_to_read_onto(part: Path, specs: list, devices: list[str] | None) -> list[str] | None:
    """The devices a part's tensors are read onto: those they were saved from, or the host (None) when their
    device bytes exceed half the device memory free now. Megatron merges split tensors (the SwiGLU halves, say)
    into new ones beside their pieces, so a part read onto a full device runs it out of memory there: read to
    the host, the merges run there and Megatron's loads copy the values to the device."""
    if not devices or not torch.cuda.is_available():
        return devices
    nbytes = sum(size for size, device in zip(spec_bytes(specs), devices, strict=True) if device != "cpu")
    free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    if 2 * nbytes <= free:
        return devices
    print(f"[zaya] local checkpoint part {part}: its {nbytes / 2**30:.1f} GiB of device tensors "
          f"exceed half the device's free {free / 2**30:.1f} GiB: read to host memory", flush=True)
    return None


def _synced(path: Path, write) -> None:
    with path.open("wb") as stream:
        write(stream)
        stream.flush()
        os.fsync(stream.fileno())


def _complete_parts(root: Path, rank: int) -> dict[int, Path]:
    parts = {}
    for step in root.glob("iter_*"):
        part = step / f"rank_{rank:05d}"
        if step.name[5:].isdigit() and (part / CHECKSUMS).is_file():
            parts[int(step.name[5:])] = part
    return parts


def _layout_of(part: Path) -> dict | None:
    try:
        return json.loads((part / LAYOUT).read_text())
    except (OSError, ValueError):
        return None


def _gather(value) -> list:
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def _warn(message: str) -> None:
    if torch.distributed.get_rank() == 0:
        print(f"zaya-pretrain: warning: {message}", file=sys.stderr, flush=True)


def remove_parts(root: str | os.PathLike) -> None:
    """Delete this node's local checkpoints in ``root``: a run started afresh (``--zaya-overwrite-save``) must not
    resume from the old run's."""
    for step in Path(root).glob("iter_*"):
        shutil.rmtree(step, ignore_errors=True)


def tier_for(args) -> "LocalTier":
    """The tier of ``--non-persistent-ckpt-type local``: the in-memory tier (copies on another node, its own
    number kept) when ``--zaya-memory-ckpt-interval`` set it."""
    memory = bool(args.zaya_memory_ckpt_interval)
    keep = args.zaya_memory_ckpt_keep if memory else args.zaya_local_ckpt_keep
    return LocalTier(args.non_persistent_local_ckpt_dir, keep, args.load, peer=memory,
                     timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))


def loading() -> int:
    """The local iteration this process's resume loads (-1: none): the persistent checkpoints no newer than it
    need no check, as they are not loaded."""
    return _loading


def _written_by_the_tier() -> None:
    """What Megatron's writer process does for a local save: nothing, as the tier's thread writes it."""


class LocalTier:
    """Megatron's ``local_checkpoint_manager`` (``save``, ``find_latest``, ``load``, ``local_ckpt_dir``) for
    ZAYA1's local tier; ``peer``: each part also copied to a rank on another node (the in-memory tier).
    ``find_latest`` is collective: every rank calls it, as Megatron does on load."""

    def __init__(self, local_ckpt_dir: str, keep: int, persistent_dir: str | None, peer: bool = False,
                 timeout: datetime.timedelta | None = None):
        self.local_ckpt_dir = local_ckpt_dir
        self.timeout = timeout  # of the thread's collectives: Megatron's, not gloo's 30-minute default
        self.keep = keep
        self.persistent_dir = persistent_dir
        self.peer = peer
        self._latest: int | None = None
        self._loaded = None  # (state, part) of the iteration find_latest chose, read as it was checked
        self._read: tuple[float, int, dict[str, float]] | None = None  # that part's seconds, bytes, threads' seconds
        self._group = None  # the gloo group of the tier's thread
        self._thread: threading.Thread | None = None  # the save in flight
        self._error: BaseException | None = None

    def _part(self, iteration: int, rank: int | None = None) -> Path:
        return rank_dir(self.local_ckpt_dir, iteration, torch.distributed.get_rank() if rank is None else rank)

    # ------------------------------------------------------------------------------------------- save
    def save(self, state, iteration: int, is_async: bool):
        """Start writing this rank's part of ``iteration`` in a thread of its own, and return. There its tensors
        are copied to host memory beside the next step's forward and backward (:mod:`.staging`: the training
        loop waits for the copies before it changes the tensors), then written; the part is copied to its keeper
        on another node (the in-memory tier); and, once every rank's part is complete, the older ones are
        pruned. A save first waits for the one before it. With ``is_async`` (``--async-save``) Megatron's writer
        process gets a request that does nothing (one without a function would never be reported done by
        Megatron's persistent writer)."""
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

        self.finish()
        if self._group is None:  # collective: every rank saves the same iterations
            self._group = torch.distributed.new_group(backend="gloo", timeout=self.timeout)
        tensors = state.pop_tensors()
        rest = copy.deepcopy(state)  # the rest (the optimizer's step counts, ...) as of this step
        state.insert_tensors(tensors)
        snapshot = Snapshot(tensors)  # from here the training loop waits for its copies: the thread must run
        self._thread = threading.Thread(target=self._write, args=(snapshot, rest, iteration, current_layout()),
                                        name=f"zaya-local-save-{iteration}", daemon=True)
        self._thread.start()
        return AsyncRequest(_written_by_the_tier, (), []) if is_async else None

    def finish(self) -> None:
        """Wait for the save in flight, and raise its error here, in the training loop."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _write(self, snapshot: Snapshot, state, iteration: int, layout: dict[str, int]) -> None:
        """The tier's thread: write the part, copy it to its keeper, then, when every rank's part is complete,
        prune. The collectives (on the tier's own gloo group, which nothing else uses) run on every rank even
        after a failed write, so that no rank waits for another that gave up. Rank 0 says how long it took (what
        sets the shortest interval that does not wait for the save before)."""
        start = time.perf_counter()
        try:
            write_part(str(self._part(iteration)), snapshot, state, layout)
        except BaseException as error:  # raised in the training loop by finish()
            self._error = error
        finally:
            snapshot.end_copies()
        try:
            written = time.perf_counter()
            if self.peer:
                peer_copy.send_copy(self._part(iteration), functools.partial(self._part, iteration), self._group)
            if not on_any_rank(self._error is not None, self._group):
                self._prune(iteration)
                if torch.distributed.get_rank() == 0:
                    print(f"[{datetime.datetime.now():%Y-%m-%d %H:%M:%S.%f}] [zaya] local checkpoint of iteration "
                          f"{iteration} complete on every rank in {time.perf_counter() - start:.2f} s: written in "
                          f"{written - start:.2f} s{', then copied to another node' if self.peer else ''}",
                          flush=True)
        except BaseException as error:
            self._error = self._error or error

    def _prune(self, iteration: int) -> None:
        """After ``iteration`` is complete on every rank: keep this rank's newest ``keep`` complete parts (and
        copies) up to it, remove those older than ``iteration`` that never completed (a crash during their write)
        and the complete ones newer than it (left by a run that went further: a resume would take them)."""
        root, rank = Path(self.local_ckpt_dir), torch.distributed.get_rank()
        source = peer_copy.keeper_and_source()[1] if self.peer else None
        steps = {int(step.name[5:]): step for step in root.glob("iter_*") if step.name[5:].isdigit()}
        for owner in [rank] + ([source] if source is not None else []):
            complete = _complete_parts(root, owner)
            kept = set(sorted((it for it in complete if it <= iteration), reverse=True)[: self.keep])
            for it, step in steps.items():
                if it < iteration and it not in kept or it > iteration and it in complete:
                    shutil.rmtree(step / f"rank_{owner:05d}", ignore_errors=True)
        for it, step in steps.items():
            if it >= iteration:  # a newer one may be another rank's next save, its part not made yet
                continue
            try:
                step.rmdir()  # emptied by the last rank of this node to prune it
            except OSError:
                pass

    # ------------------------------------------------------------------------------------------- load
    def find_latest(self) -> int:
        """The newest iteration whose parts are complete and intact on every rank (or at its keeper) and were
        written with this layout, newer than the persistent checkpoint, or -1. A newer local checkpoint of
        another layout than the persistent one is refused. Each rank's part is read as it is checked and kept for
        :meth:`load`; rank 0 says how long the phases took."""
        global _loading
        if self._latest is None:
            start = time.perf_counter()
            self._latest = _loading = self._find_latest()
            if self._latest >= 0 and torch.distributed.get_rank() == 0:
                (seconds, size, spent), total = self._read, time.perf_counter() - start
                print(f"[zaya] local checkpoint found and read in {total:.2f} s: its {size / 2**30:.2f} GiB of "
                      f"tensors read and checked in {seconds:.2f} s (summed over the threads: reading "
                      f"{spent['reads']:.2f} s, checksums {spent['checksums']:.2f} s, to the device "
                      f"{spent['copies']:.2f} s), the rest (listing, the ranks agreeing, the small files, copies "
                      f"from other nodes) {total - seconds:.2f} s", flush=True)
        return self._latest

    def _find_latest(self) -> int:
        root, layout = Path(self.local_ckpt_dir), current_layout()
        rank = layout["rank"]
        parts = _complete_parts(root, rank)
        same = {it: _layout_of(part) == layout for it, part in parts.items()}
        keeper, source = peer_copy.keeper_and_source() if self.peer else (None, None)
        held = set() if source is None else {
            it for it, part in _complete_parts(root, source).items() if _layout_of(part) == {**layout, "rank": source}}
        everyone = _gather((same, held, keeper))
        has_copy = [everyone[k][1] if k is not None else set() for _, _, k in everyone]  # held by each's keeper
        persistent = None  # verified only when a local candidate is not newer than the tracker's step
        marker = read_tracker(self.persistent_dir) if self.persistent_dir else None
        seen = sorted({it for ranks, _, _ in everyone for it in ranks} | {it for _, h, _ in everyone for it in h},
                      reverse=True)
        for it in seen:
            if persistent is None and (marker is None or not marker.isdigit() or it <= int(marker)):
                persistent = self._persistent_iteration()
            if persistent is not None and it <= persistent:
                break
            if any(it in ranks and not ranks[it] for ranks, _, _ in everyone):
                shown = persistent if persistent is not None else int(marker)
                raise UsageError(
                    f"--non-persistent-local-ckpt-dir {self.local_ckpt_dir} holds iteration {it}, newer than the "
                    f"persistent checkpoint ({shown if shown >= 0 else 'none'}), saved with another world "
                    f"size or parallel layout; resume with the layout it was saved with, or give an empty "
                    f"--non-persistent-local-ckpt-dir to resume from --load")
            missing = [r for r, (ranks, _, _) in enumerate(everyone) if it not in ranks and it not in has_copy[r]]
            if missing:
                _warn(f"local checkpoint {root / step_name(it)} is incomplete (no part from rank "
                      f"{', '.join(map(str, missing[:8]))}{' ...' if len(missing) > 8 else ''}); skipped")
                continue
            problems = self._read_part(parts[it]) if it in parts else ["its part is missing"]
            if self.peer:
                problems = self._take_copies(it, bool(problems) and it in has_copy[rank],
                                             [k for _, _, k in everyone], problems)
            problems = sorted(p for ranks in _gather([f"rank {rank}: {p}" for p in problems]) for p in ranks)
            if not problems:
                if rank == 0:
                    older = persistent if persistent is not None else int(marker)  # unread: not loaded
                    print(f"[zaya] resuming from the local checkpoint {root / step_name(it)} (the persistent one in "
                          f"--load: {older if older >= 0 else 'none'})", flush=True)
                return it
            self._loaded = None  # not taken: its memory back
            _warn(f"local checkpoint {root / step_name(it)} is damaged ({problems[0]}"
                  f"{f' and {len(problems) - 1} more' if len(problems) > 1 else ''}); skipped")
        return -1

    def _read_part(self, part: Path) -> list[str]:
        """What is wrong with this rank's part ``part``, read once (:func:`read_part`) and kept for :meth:`load`
        when intact."""
        self._loaded = None  # the part read before, not taken: its memory back first
        start = time.perf_counter()
        state, problems, read = read_part(part)
        if state is not None:
            self._loaded = (state, str(part))
            self._read = (time.perf_counter() - start, sum(t.nbytes for t in read.tensors), read.seconds)
        return problems

    def _take_copies(self, iteration: int, need: bool, keepers: list[int | None], problems: list[str]) -> list[str]:
        """Collective: every rank without an intact part of ``iteration`` (``need``) receives its keeper's copy
        in its place; returns what is still wrong with this rank's part."""
        needs = _gather(need)
        received = peer_copy.fetch(needs, keepers, self._part(iteration), functools.partial(self._part, iteration))
        if need:
            problems = (self._read_part(self._part(iteration)) if received else
                        problems + ["its copy on another node differs from its checksums"])
        taken = _gather(received and not problems)
        if torch.distributed.get_rank() == 0 and any(taken):
            print(f"[zaya] local checkpoint {Path(self.local_ckpt_dir) / step_name(iteration)}: the part of rank "
                  f"{', '.join(str(r) for r, t in enumerate(taken) if t)} taken from its copy on another node",
                  flush=True)
        return problems

    def _persistent_iteration(self) -> int:
        """The iteration Megatron loads from ``--load`` (through ``read_metadata``: the newest intact), or -1."""
        from megatron.training import checkpointing

        tracker = Path(self.persistent_dir or "") / TRACKER
        if not self.persistent_dir or not tracker.is_file():
            return -1
        iteration, release = checkpointing.read_metadata(str(tracker))
        return 0 if release else int(iteration)

    def load(self):
        """This rank's part of the iteration :meth:`find_latest` chose (read as it checked it), its tensors on
        their devices, and the part's directory."""
        self.find_latest()
        return self._loaded

    def done_loading(self) -> None:
        """Drop the part :meth:`load` returned, once Megatron has taken its values (at the end of set-up): kept, its
        tensors stayed on the device for the rest of the run, a second copy of those Megatron copied from."""
        self._loaded = None
