"""A run resumes where it saves: without ``--load``, zaya-pretrain loads from ``--save`` (Megatron starts afresh
from a directory without a checkpoint). :func:`check_save_and_load` refuses a run that would start afresh into a
directory holding a checkpoint (another ``--load``, ``--finetune``) unless ``--zaya-overwrite-save`` is given, and
a ``--load`` that does not exist or holds no checkpoint to load (Megatron starts from random weights then).
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

from ..errors import UsageError
from .format import CHECKSUMS, TRACKER, read_tracker

OVERWRITE_FLAG = "--zaya-overwrite-save"
# Flags of a run that starts afresh from another checkpoint; a resume from --save leaves them out.
_FRESH_START_FLAGS = (OVERWRITE_FLAG, "--finetune", "--no-load-optim", "--no-load-rng")


def _same(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def held_checkpoint(save_dir: str) -> str | None:
    """What ``save_dir`` holds that a resume would load ('iteration 8'), or None for no complete checkpoint."""
    root = Path(save_dir)
    marker = read_tracker(root)
    if marker is not None:
        return "release" if marker == "release" else f"iteration {marker}"
    saved = [p for p in root.glob("iter_*") if (p / CHECKSUMS).is_file()]  # a damaged or garbage tracker
    return f"iteration {int(max(saved).name[5:])}" if saved else None


def _nothing_to_load(load: str) -> str:
    """Why the existing directory ``load``, which holds no checkpoint, cannot be loaded, and the fix."""
    root = Path(load)
    if (root / "config.json").is_file() and any(root.glob("*.safetensors")):
        return (f"--load {load} holds a Hugging Face checkpoint, not a Megatron one; convert it first (zaya-convert "
                f"import-hf {load} {root.name}-megatron) and --load that")
    if root.name.startswith("iter_") and read_tracker(root.parent) is not None:
        return (f"--load {load} is one step of the checkpoint directory {root.parent}; give --load {root.parent} "
                "(it loads its newest intact step; --ckpt-step N picks another)")
    return (f"--load {load} holds no checkpoint ({TRACKER} and a complete iter_* directory are missing); give the "
            "checkpoint directory, or drop --load to start afresh")


def check_save_and_load(args, argv: list[str]) -> str | None:
    """Refuse a ``--load`` that does not exist or holds no checkpoint (unless it is the ``--save`` directory of a run
    that starts, not ``--finetune``), and a fresh start into a ``--save`` that holds a checkpoint (unless
    ``--zaya-overwrite-save``). Returns the line to print when the run resumes from ``--save`` without ``--load``
    being given."""
    if args.load and not Path(args.load).exists() and not _same(args.load, args.save):
        raise UsageError(f"--load {args.load}: no such directory (relative paths start at {os.getcwd()}); give the "
                         "checkpoint directory, or drop --load to start afresh")
    if args.load and Path(args.load).is_dir() and held_checkpoint(args.load) is None \
            and (args.finetune or not _same(args.load, args.save)):
        raise UsageError(_nothing_to_load(args.load))
    held = held_checkpoint(args.save) if args.save else None
    if held is None:
        return None
    resumes = _same(args.load, args.save) and not args.finetune
    if args.zaya_overwrite_save:
        if _same(args.load, args.save):
            raise UsageError(f"{OVERWRITE_FLAG} with --load {args.load}, the --save directory, would delete the "
                             "checkpoint it loads; save into another directory")
        return None
    if not resumes:
        reason = "--finetune restarts at iteration 0" if args.finetune else f"it loads --load {args.load}"
        undo = "--finetune" if args.finetune else "--load"
        raise UsageError(f"--save {args.save} holds a checkpoint ({held}) of another run, which this run would replace "
                         f"({reason}); to resume that run drop {undo}, to keep it choose another --save, to replace "
                         f"it add {OVERWRITE_FLAG}")
    if "--load" not in [a.split("=", 1)[0] for a in argv]:
        return (f"[zaya] resuming from the checkpoint in --save {args.save} ({held}); {OVERWRITE_FLAG} starts "
                "afresh instead")
    return None


def overwrite_on_first_launch_only(argv: list[str], relaunches: int) -> tuple[list[str], str | None]:
    """``argv`` for a job's launch: a restart or requeue of a job started with ``--zaya-overwrite-save`` resumes
    what the job itself saved, instead of deleting it again. Also the line saying so, or None."""
    if not relaunches or OVERWRITE_FLAG not in argv:
        return argv, None
    return [a for a in argv if a != OVERWRITE_FLAG], (
        f"[zaya] relaunch {relaunches} of this job: {OVERWRITE_FLAG} deleted the old checkpoints at its first "
        "launch only; resuming from --save")


def remove_checkpoints(save_dir: str) -> str | None:
    """``--zaya-overwrite-save``: delete the checkpoints in ``save_dir`` (tracker first, so that a kill midway
    leaves no checkpoint named); returns the line saying what went, or None if there was none."""
    held = held_checkpoint(save_dir)
    if held is None:
        return None
    root = Path(save_dir)
    (root / TRACKER).unlink(missing_ok=True)
    steps = sorted(p for p in [*root.glob("iter_*"), root / "release"] if p.is_dir())
    for path in steps:
        shutil.rmtree(path)
    return (f"[zaya] {OVERWRITE_FLAG}: deleted the {len(steps)} checkpoint(s) in {save_dir} (the newest: {held}); "
            "starting afresh")


def resume_command(argv: list[str], save: str | None) -> str:
    """The command that resumes this run from ``save``: this one, without the flags of a fresh start."""
    kept, skip = [], False
    for i, arg in enumerate(argv):
        name = arg.split("=", 1)[0]
        if skip:
            skip = False
        elif name in _FRESH_START_FLAGS:
            continue
        elif name == "--load" and not _same(arg.split("=", 1)[1] if "=" in arg else
                                            (argv[i + 1] if i + 1 < len(argv) else None), save):
            skip = "=" not in arg
        else:
            kept.append(arg)
    launcher = "zaya-torchrun ... -m megatron_zaya.pretrain" if "TORCHELASTIC_RUN_ID" in os.environ else "zaya-pretrain"
    return " ".join([launcher, *map(shlex.quote, kept)])
