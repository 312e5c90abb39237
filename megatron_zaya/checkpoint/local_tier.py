"""ZAYA1's local checkpoint tier: each rank writes its own shards to node-local storage (NVMe, ``/dev/shm``).

``--non-persistent-ckpt-type local --non-persistent-local-ckpt-dir DIR --non-persistent-save-interval N`` saves
every N steps, between the persistent saves of ``--save-interval``. Megatron builds what a rank holds
(``MCoreTensorAwareStateDict``: the common state, this rank's tensor shards; with the default
``--non-persistent-local-ckpt-algo fully_parallel`` a replicated shard is kept by one data-parallel rank and
exchanged on load) and hands it to the ``local_checkpoint_manager`` of its checkpointing context: an instance
of :class:`LocalTier`, installed by the ``checkpointing.local_tier`` patch in place of NVIDIA's resiliency
package. On disk::

    DIR/iter_0000040/rank_00003/state.pt             this rank's shards (torch.save, CPU tensors)
                                layout.json          world size, parallel sizes and rank that wrote it
                                zaya_checksums.json  sizes and CRC-32 of both, written last and atomically

A rank's part is complete when its ``zaya_checksums.json`` exists; an iteration can be resumed when every rank
of the same layout holds an intact part. Each rank keeps its last ``--zaya-local-ckpt-keep`` complete parts.
No file is shared between ranks, so nothing here needs a shared filesystem.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from ..errors import UsageError
from .format import CHECKSUMS, TRACKER, recorded_files, step_name, write_checksums
from .integrity import damage
from .tiers import stage, take_copies

STATE = "state.pt"
LAYOUT = "layout.json"


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


def stage_state(state, which: frozenset[int] | None = None):
    """:func:`~.tiers.stage` for the tensors of a rank's ``MCoreTensorAwareStateDict``, in place."""
    state.insert_tensors(stage(state.pop_tensors(), which))
    return state


def write_part(path: str, state, layout: dict[str, int]) -> None:
    """Write a rank's part (in the background writer for ``--async-save``): its tensors staged to host memory,
    the shards, the layout, then the checksums, last and atomically. A part of the same iteration left by an
    earlier run is removed first."""
    stage_state(state)
    part = Path(path)
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    _synced(part / STATE, lambda stream: torch.save(state, stream))
    _synced(part / LAYOUT, lambda stream: stream.write(json.dumps(layout).encode()))
    write_checksums(part)


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


class LocalTier:
    """Megatron's ``local_checkpoint_manager`` (``save``, ``find_latest``, ``load``, ``local_ckpt_dir``) for
    ZAYA1's local tier. ``find_latest`` is collective: every rank calls it, as Megatron does on load."""

    def __init__(self, local_ckpt_dir: str, keep: int, persistent_dir: str | None):
        self.local_ckpt_dir = local_ckpt_dir
        self.keep = keep
        self.persistent_dir = persistent_dir
        self._latest: int | None = None
        self._loaded = None

    # ------------------------------------------------------------------------------------------- save
    def save(self, state, iteration: int, is_async: bool):
        """Write this rank's part of ``iteration``; with ``is_async`` return the request that does it in the
        background writer (Megatron schedules it and runs its finalize functions once every rank is done)."""
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

        path = str(rank_dir(self.local_ckpt_dir, iteration, torch.distributed.get_rank()))
        prune = functools.partial(self._prune, iteration)
        if not is_async:
            write_part(path, state, current_layout())
            prune()
            return None
        tensors, originals = take_copies(state.pop_tensors())
        # The rest (the optimizer's step counts, ...) as of this step: Megatron's writer queue pickles the request
        # later, from a thread, while training goes on and changes those tensors in place.
        state = copy.deepcopy(state)
        state.insert_tensors(tensors)
        return AsyncRequest(write_part, (path, state, current_layout()), [prune],
                            preload_fn=functools.partial(stage_state, state, originals))

    def _prune(self, iteration: int) -> None:
        """After ``iteration`` is complete on every rank: keep this rank's newest ``keep`` complete parts, and
        remove parts older than ``iteration`` that never completed (a crash during their write)."""
        root, rank = Path(self.local_ckpt_dir), torch.distributed.get_rank()
        complete = sorted(_complete_parts(root, rank), reverse=True)
        kept = set(complete[: self.keep])
        for step in root.glob("iter_*"):
            if not step.name[5:].isdigit() or int(step.name[5:]) >= iteration or int(step.name[5:]) in kept:
                continue
            shutil.rmtree(step / f"rank_{rank:05d}", ignore_errors=True)
            try:
                step.rmdir()  # the last rank of this node to prune it
            except OSError:
                pass

    # ------------------------------------------------------------------------------------------- load
    def find_latest(self) -> int:
        """The newest iteration whose parts are complete and intact on every rank and were written with this
        layout, or -1. A newer local checkpoint of another layout than the persistent one is refused."""
        if self._latest is None:
            self._latest = self._find_latest()
        return self._latest

    def _find_latest(self) -> int:
        root, layout = Path(self.local_ckpt_dir), current_layout()
        parts = _complete_parts(root, layout["rank"])
        same = {it: _layout_of(part) == layout for it, part in parts.items()}
        everyone = _gather(same)
        persistent = self._persistent_iteration()
        seen = sorted({it for ranks in everyone for it in ranks}, reverse=True)
        for it in (it for it in seen if it > persistent):
            if any(it in ranks and not ranks[it] for ranks in everyone):
                raise UsageError(
                    f"--non-persistent-local-ckpt-dir {self.local_ckpt_dir} holds iteration {it}, newer than the "
                    f"persistent checkpoint ({persistent if persistent >= 0 else 'none'}), saved with another world "
                    f"size or parallel layout; resume with the layout it was saved with, or give an empty "
                    f"--non-persistent-local-ckpt-dir to resume from --load")
            missing = [rank for rank, ranks in enumerate(everyone) if it not in ranks]
            if missing:
                _warn(f"local checkpoint {root / step_name(it)} is incomplete (no part from rank "
                      f"{', '.join(map(str, missing[:8]))}{' ...' if len(missing) > 8 else ''}); skipped")
                continue
            recorded = recorded_files(parts[it]) or {}
            problems = damage(parts[it], list(recorded), recorded)
            problems = sorted(p for ranks in _gather([f"rank {layout['rank']}: {p}" for p in problems]) for p in ranks)
            if not problems:
                if layout["rank"] == 0:
                    print(f"[zaya] resuming from the local checkpoint {root / step_name(it)} (the persistent one in "
                          f"--load: {persistent if persistent >= 0 else 'none'})", flush=True)
                return it
            _warn(f"local checkpoint {root / step_name(it)} is damaged ({problems[0]}"
                  f"{f' and {len(problems) - 1} more' if len(problems) > 1 else ''}); skipped")
        return -1

    def _persistent_iteration(self) -> int:
        """The iteration Megatron loads from ``--load`` (through ``read_metadata``: the newest intact), or -1."""
        from megatron.training import checkpointing

        tracker = Path(self.persistent_dir or "") / TRACKER
        if not self.persistent_dir or not tracker.is_file():
            return -1
        iteration, release = checkpointing.read_metadata(str(tracker))
        return 0 if release else int(iteration)

    def load(self):
        """This rank's part of the iteration :meth:`find_latest` chose, its tensors back on their devices."""
        if self._loaded is None:
            part = rank_dir(self.local_ckpt_dir, self.find_latest(), torch.distributed.get_rank())
            state = torch.load(part / STATE, map_location="cpu", weights_only=False)
            state.restore_tensor_device(non_blocking=False)
            self._loaded = (state, str(part))
        return self._loaded
