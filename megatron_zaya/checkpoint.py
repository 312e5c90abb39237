"""Megatron ``torch_dist`` checkpoints of ZAYA1 models, in the layout ``megatron.training`` reads and writes.

A checkpoint directory holds ``latest_checkpointed_iteration.txt`` (an iteration number or ``release``)
and one sub-directory per saved step (``iter_0000100`` or ``release``) written by
``megatron.core.dist_checkpointing``. Its common state has ``args`` (the training arguments, with
``args.zaya_architecture``: the :data:`~megatron_zaya.config.ARCHITECTURE_FIELDS` of the model), the
iteration and the checkpoint version; its sharded state has ``model`` (and, from training, the optimizer).

Every step directory saved by megatron-zaya (training or conversion) also holds ``zaya_checksums.json``: the
size and CRC-32 of each of its files, written after all of them and before the tracker names the step
(:func:`write_checksums`). :func:`step_damage` compares the files with it; nothing reads a checkpoint's files before
that check: :func:`verified_step` for the tools that take the tracker's step (``zaya-convert export-hf``,
``load_pretrained``), ``reliability.newest_intact_checkpoint`` for a resume (the ranks share the reading).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path

import torch

from .config import ARCHITECTURE_FIELDS, ZayaConfig, architecture, zaya_config
from .errors import CheckpointError, ZayaConfigError

TRACKER = "latest_checkpointed_iteration.txt"
CHECKSUMS = "zaya_checksums.json"
_CHUNK = 16 << 20
_THREADS = 16  # zlib.crc32 releases the GIL: threads hash files in parallel, bounded by the disk


def read_tracker(ckpt_dir: str | os.PathLike) -> str | None:
    """The tracker's marker (``"release"`` or an iteration number), or None if missing, empty or garbage."""
    try:
        marker = (Path(ckpt_dir) / TRACKER).read_text(errors="replace").strip()
    except OSError:
        return None
    return marker if marker == "release" or marker.isdigit() else None


def step_name(marker: str | int) -> str:
    """``release`` or ``iter_0000100``: the directory name of a tracker marker."""
    return "release" if marker == "release" else f"iter_{int(marker):07d}"


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


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as stream:
        while chunk := stream.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _hash_all(paths: list[Path]) -> list[int]:
    if len(paths) <= 1:
        return [_crc32(p) for p in paths]
    with concurrent.futures.ThreadPoolExecutor(min(_THREADS, len(paths))) as pool:
        return list(pool.map(_crc32, paths))


def record_written(paths: list[str | os.PathLike], rank: int) -> None:
    """Record the size and CRC-32 of the files ``paths`` that ``rank`` just wrote (all in one step directory),
    for :func:`write_checksums` to take instead of reading them again (the background writer calls it)."""
    if not paths:
        return
    paths = [Path(p) for p in paths]
    table = {p.name: [p.stat().st_size, crc] for p, crc in zip(paths, _hash_all(paths), strict=True)}
    _write_atomically(paths[0].parent / f".{CHECKSUMS}.rank-{rank:05d}", {"algorithm": "crc32", "files": table})


def _write_atomically(target: Path, record: dict) -> None:
    staging = target.with_name(f".{CHECKSUMS}.tmp-{os.getpid()}")
    with staging.open("w") as stream:
        json.dump(record, stream)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(staging, target)


def check_written(path: str | os.PathLike) -> None:
    """Raise :class:`CheckpointError` unless every byte range that the ``.metadata`` of the ``torch_dist`` step
    directory ``path`` records lies in a file that exists and is that long (a step without one passes)."""
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(path)
    if not (path / ".metadata").is_file():
        return
    ends: dict[str, int] = {}
    for info in FileSystemReader(str(path)).read_metadata().storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        size = (path / name).stat().st_size if (path / name).is_file() else None
        if size is None or size < end:
            raise CheckpointError(f"{path / name} {'is missing' if size is None else f'has {size} bytes'}, but the "
                                  f"checkpoint's .metadata places data up to byte {end} in it: the save is incomplete")


def write_checksums(path: str | os.PathLike) -> None:
    """Record the size and CRC-32 of every file of the step directory ``path`` in :data:`CHECKSUMS`, written
    last and atomically (staged, fsynced, renamed), so that its presence means every file was complete.
    Files the writers recorded (:func:`record_written`) with the size they still have are not read again."""
    path = Path(path)
    files = sorted(f for f in path.rglob("*") if f.is_file() and f.name != CHECKSUMS and not f.name.startswith(
        f".{CHECKSUMS}"))
    records = sorted(path.glob(f".{CHECKSUMS}.rank-*"))
    known = {}
    for record in records:
        known.update(recorded_files(path, record.name) or {})
    names = [str(f.relative_to(path)) for f in files]
    sizes = [f.stat().st_size for f in files]
    crcs = [known[n][1] if known.get(n, [None])[0] == size else None for n, size in zip(names, sizes)]
    hashed = iter(_hash_all([f for f, crc in zip(files, crcs) if crc is None]))
    table = {n: [size, next(hashed) if crc is None else crc] for n, size, crc in zip(names, sizes, crcs)}
    _write_atomically(path / CHECKSUMS, {"algorithm": "crc32", "files": table})
    for record in records:
        record.unlink()


def recorded_files(path: str | os.PathLike, name: str = CHECKSUMS) -> dict[str, list[int]] | None:
    """``{file: [size, crc32]}`` recorded at save, None without a readable record (older or foreign saves)."""
    try:
        record = json.loads((Path(path) / name).read_text())
        return {str(file): [int(size), int(crc)] for file, (size, crc) in record["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def damage(path: str | os.PathLike, names: list[str], recorded: dict[str, list[int]]) -> list[str]:
    """What is wrong with the files ``names`` of the step directory ``path`` compared with ``recorded``
    (missing, another size, another checksum); empty when they are intact. Sizes first (no reads), then the
    checksums of the rest in parallel threads."""
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
    for name, crc in zip(to_hash, _hash_all([path / n for n in to_hash]), strict=True):
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


def publish_permissions(path: str | os.PathLike) -> None:
    """Give ``path`` and the directories below it the permissions ``mkdir`` would (``mkdtemp`` makes them
    private to the user), before they are renamed into place."""
    umask = os.umask(0)
    os.umask(umask)
    path = Path(path)
    for directory in [path, *(p for p in path.rglob("*") if p.is_dir())]:
        directory.chmod(0o777 & ~umask)


def read_config(step: str | os.PathLike, **runtime) -> ZayaConfig:
    """The :class:`ZayaConfig` the step directory ``step`` (from :func:`verified_step`) was saved with
    (``runtime`` adds non-architecture fields)."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(step))
    args = common.get("args")
    arch = getattr(args, "zaya_architecture", None)
    if arch is None:
        raise CheckpointError(f"{step} was not written by megatron-zaya (no args.zaya_architecture); "
                              "convert it with the tool that made it")
    runtime.setdefault("params_dtype", getattr(args, "params_dtype", None) or torch.float32)
    try:
        return zaya_config(**arch, **runtime)
    except ZayaConfigError as error:
        raise CheckpointError(f"{step} stores an invalid ZAYA1 config: {error}") from error


def architecture_differences(saved: dict, cfg: ZayaConfig) -> list[tuple[str, object, object]]:
    """``(field, checkpoint value, this model's)`` for every field of a checkpoint's recorded architecture
    (``args.zaya_architecture``) that differs from ``cfg``'s."""
    ours = architecture(cfg)
    return [(name, saved[name], ours[name]) for name in ARCHITECTURE_FIELDS
            if name in saved and _normalised(saved[name]) != _normalised(ours[name])]


def _normalised(value):
    return list(value) if isinstance(value, tuple) else value


def checkpoint_args(cfg: ZayaConfig) -> argparse.Namespace:
    """The ``args`` a converted checkpoint carries: what ``megatron.training`` checks on load, plus ours."""
    return argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        max_position_embeddings=cfg.max_position_embeddings, padded_vocab_size=cfg.vocab_size,
        add_position_embedding=False, params_dtype=cfg.params_dtype, zaya_architecture=architecture(cfg),
    )


def save(model, cfg: ZayaConfig, ckpt_dir: str | os.PathLike, *, iteration: int | None = None) -> Path:
    """Write ``model`` (a single-process ``ZayaModel``) as a new checkpoint directory ``ckpt_dir``.

    The step is written next to its final place and renamed into it, and the tracker is written last,
    so an interrupted save never leaves a tracker pointing to a partial checkpoint.
    """
    from megatron.core import dist_checkpointing

    root = Path(ckpt_dir)
    root.mkdir(parents=True, exist_ok=True)
    name = "release" if iteration is None else f"iter_{iteration:07d}"
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    state = {
        "args": checkpoint_args(cfg), "checkpoint_version": 3.0, "iteration": iteration or 0,
        "model": model.sharded_state_dict(),
    }
    dist_checkpointing.save(state, str(staging))
    write_checksums(staging)
    publish_permissions(staging)
    final = root / name
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)
    (root / f".{TRACKER}.tmp").write_text("release" if iteration is None else str(iteration))
    (root / f".{TRACKER}.tmp").rename(root / TRACKER)
    return final


def load(model, step: str | os.PathLike) -> None:
    """Load the model weights (and balancing biases) of the step directory ``step`` (from :func:`verified_step`)
    into ``model`` in place."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(step))
    model.load_state_dict(state["model"])
