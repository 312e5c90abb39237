"""Whether a checkpoint's files are the ones saved, and which step to load: every file is compared with the sizes
and CRC-32 that :func:`~.format.write_checksums` recorded at save, and nothing reads a checkpoint's files before
that check. :func:`verified_step` serves the tools that take the tracker's step (``zaya-convert export-hf``,
``load_pretrained``); :func:`newest_intact_checkpoint` serves a resume (the ranks share the reading).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import CheckpointError, UsageError
from ..training.ledger import LEDGER
from .format import TRACKER, file_crcs, read_tracker, recorded_files, step_name


def verified_step(ckpt_dir: str | os.PathLike) -> Path:
    """The directory of the checkpoint's latest step, from its tracker file, after every file of it was checked
    against the checksums recorded at save (:class:`CheckpointError` naming the damage, and the newest intact
    older step if there is one). A step saved without checksums (an older megatron-zaya) is taken as it is."""
    root = Path(ckpt_dir)
    tracker = root / TRACKER
    if not tracker.is_file():
        raise CheckpointError(f"{root} has no {TRACKER}: not a Megatron checkpoint directory")
    marker = read_tracker(root)
    if marker is None:
        raise CheckpointError(f"{tracker} holds no iteration (empty or damaged); write the iteration to load into it")
    path = root / step_name(marker)
    if not (path / "metadata.json").is_file():
        raise CheckpointError(f"{path} is missing or incomplete (no metadata.json); the tracker points to a broken save")
    problems = step_damage(path)
    if problems:
        older = sorted((p for p in root.glob("iter_*") if p.name[5:].isdigit() and p.is_dir()
                        and (marker == "release" or int(p.name[5:]) < int(marker))), reverse=True)
        intact = next((p for p in older if not step_damage(p, tracker_named=False)), None)
        hint = f", or write {int(intact.name[5:])} into {tracker} to take the newest intact one" if intact else ""
        more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
        raise CheckpointError(f"{path} is damaged ({problems[0]}{more}); restore it from a copy{hint}")
    return path


def damage(path: str | os.PathLike, names: list[str], recorded: dict[str, list[int]],
           crcs: Callable[[list[Path]], list[int]] = file_crcs) -> list[str]:
    """What is wrong with the files ``names`` of the step directory ``path`` compared with ``recorded``
    (missing, another size, another checksum); empty when they are intact. Sizes first (no reads), then the
    checksums of the rest: ``crcs`` of their paths, by default read for that alone in parallel threads (a reader
    that needs the bytes passes its own, which checksums them as it reads them)."""
    path = Path(path)
    problems, to_hash = [], []
    for name in names:
        size = recorded[name][0]
        try:
            actual = (path / name).stat().st_size
        except OSError:
            problems.append(f"{name} is missing")
            continue
        if actual != size:
            problems.append(f"{name} has {actual} bytes, {size} when saved")
        else:
            to_hash.append(name)
    for name, crc in zip(to_hash, crcs([path / n for n in to_hash]), strict=True):
        if crc != recorded[name][1]:
            problems.append(f"{name} differs from its checksum at save")
    return problems


def _writer(name: str) -> int | None:
    """The rank that wrote a ``torch_dist`` data file (``__<rank>_<n>.distcp``), None for other files."""
    parts = name.split("_")
    return int(parts[2]) if name.startswith("__") and len(parts) > 3 and parts[2].isdigit() else None


def _share(recorded: dict[str, list[int]], rank: int, world: int) -> list[str]:
    """The files ``rank`` of ``world`` verifies: those it wrote, and of the rest (metadata, files of ranks beyond
    this world size) a share balanced by size, assigned alike on every rank."""
    own = [n for n in recorded if _writer(n) == rank]
    rest = sorted((n for n in recorded if _writer(n) is None or _writer(n) >= world),
                  key=lambda n: (-recorded[n][0], n))
    load = [0] * world
    for name in rest:
        target = load.index(min(load))
        load[target] += recorded[name][0] + 1
        if target == rank:
            own.append(name)
    return own


def step_damage(path: str | os.PathLike, tracker_named: bool = True, rank: int = 0, world: int = 1) -> list[str]:
    """What is wrong with the step directory ``path`` (empty: intact), from the files that ``rank`` of ``world``
    processes verifies (every file for one process). A step saved without checksums (an older or a foreign save)
    is trusted only when the tracker names it."""
    path = Path(path)
    if not path.is_dir():
        return ["missing"]
    recorded = recorded_files(path)
    if recorded is None:
        return [] if tracker_named else ["no checksum record: incomplete, or not saved by megatron-zaya"]
    return damage(path, _share(recorded, rank, world), recorded)


def _rank_and_size() -> tuple[int, int]:
    dist = torch.distributed
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _damage_on_all_ranks(path: Path, tracker_named: bool) -> list[str]:
    """What is wrong with the step directory ``path``; each rank reads only its share of the files."""
    rank, world = _rank_and_size()
    problems = step_damage(path, tracker_named, rank, world)
    if world > 1:
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, problems)
        problems = sorted({p for part in gathered for p in part})
    return problems


def newest_intact_checkpoint(load_dir: str, loaded_instead: int = -1) -> str:
    """The tracker marker of the checkpoint to load from ``load_dir`` (collective: every rank calls it).

    The tracker's checkpoint if its files match the checksums recorded at save; else, named in one line,
    the newest older ``iter_*`` that does (every one when the tracker itself is damaged). None intact:
    :class:`UsageError` (exit 2), so that a run never trains on damaged weights. A tracker's step no newer than
    ``loaded_instead`` (a local checkpoint the run loads instead) is returned unread.
    """
    root = Path(load_dir)
    marker = read_tracker(root)
    if marker is not None and marker.isdigit() and int(marker) <= loaded_instead:
        return marker
    saved = sorted((int(p.name[5:]) for p in root.glob("iter_*") if p.name[5:].isdigit() and p.is_dir()),
                   reverse=True)
    if marker == "release":
        candidates = ["release"]
    else:
        candidates = ([marker] if marker else []) + [str(i) for i in saved if marker is None or i < int(marker)]
    damaged = [] if marker else [f"{root / TRACKER} (empty or not an iteration)"]
    for candidate in candidates:
        path = root / step_name(candidate)
        problems = _damage_on_all_ranks(path, candidate == marker)
        if not problems:
            if damaged and _rank_and_size()[0] == 0:
                print(f"zaya-pretrain: warning: {'; '.join(damaged)}: damaged; loading the newest intact "
                      f"checkpoint, {path} (iteration {candidate})", file=sys.stderr, flush=True)
                LEDGER.checkpoint_skipped(damaged, candidates[0], candidate)
            return candidate
        more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
        damaged.append(f"{path} ({problems[0]}{more})")
    raise UsageError(f"no intact checkpoint in --load {load_dir}: {'; '.join(damaged) or 'none saved'}; restore "
                     "it from a copy, or start afresh with another --save and --load")
