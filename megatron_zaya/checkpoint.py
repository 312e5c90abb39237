"""Megatron ``torch_dist`` checkpoints of ZAYA1 models, in the layout ``megatron.training`` reads and writes.

A checkpoint directory holds ``latest_checkpointed_iteration.txt`` (an iteration number or ``release``)
and one sub-directory per saved step (``iter_0000100`` or ``release``) written by
``megatron.core.dist_checkpointing``. Its common state has ``args`` (the training arguments, with
``args.zaya_architecture``: the :data:`~megatron_zaya.config.ARCHITECTURE_FIELDS` of the model), the
iteration and the checkpoint version; its sharded state has ``model`` (and, from training, the optimizer).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .config import ARCHITECTURE_FIELDS, ZayaConfig, ZayaConfigError, architecture, zaya_config

TRACKER = "latest_checkpointed_iteration.txt"


class CheckpointError(ValueError):
    """Not a usable ZAYA1 Megatron checkpoint; the message names the problem and the fix."""


def step_dir(ckpt_dir: str | os.PathLike) -> Path:
    """The directory of the checkpoint's latest step, from its tracker file."""
    root = Path(ckpt_dir)
    tracker = root / TRACKER
    if not tracker.is_file():
        raise CheckpointError(f"{root} has no {TRACKER}: not a Megatron checkpoint directory")
    marker = tracker.read_text().strip()
    name = "release" if marker == "release" else f"iter_{int(marker):07d}"
    path = root / name
    if not (path / "metadata.json").is_file():
        raise CheckpointError(f"{path} is missing or incomplete (no metadata.json); the tracker points to a broken save")
    return path


def read_config(ckpt_dir: str | os.PathLike, **runtime) -> ZayaConfig:
    """The :class:`ZayaConfig` a checkpoint was saved with (``runtime`` adds non-architecture fields)."""
    from megatron.core import dist_checkpointing

    path = step_dir(ckpt_dir)
    common = dist_checkpointing.load_common_state_dict(str(path))
    args = common.get("args")
    arch = getattr(args, "zaya_architecture", None)
    if arch is None:
        raise CheckpointError(f"{path} was not written by megatron-zaya (no args.zaya_architecture); "
                              "convert it with the tool that made it")
    runtime.setdefault("params_dtype", getattr(args, "params_dtype", None) or torch.float32)
    try:
        return zaya_config(**arch, **runtime)
    except ZayaConfigError as error:
        raise CheckpointError(f"{path} stores an invalid ZAYA1 config: {error}") from error


def architecture_differences(ckpt_dir: str | os.PathLike, cfg: ZayaConfig) -> list[str]:
    """``field: checkpoint value != this model's`` for every architecture field that differs (empty if the
    checkpoint matches or does not record its architecture)."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(step_dir(ckpt_dir)))
    saved = getattr(common.get("args"), "zaya_architecture", None) or {}
    ours = architecture(cfg)
    return [f"{name}: {saved[name]!r} in the checkpoint, {ours[name]!r} here"
            for name in ARCHITECTURE_FIELDS if name in saved and _normalised(saved[name]) != _normalised(ours[name])]


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
    final = root / name
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)
    (root / f".{TRACKER}.tmp").write_text("release" if iteration is None else str(iteration))
    (root / f".{TRACKER}.tmp").rename(root / TRACKER)
    return final


def load(model, ckpt_dir: str | os.PathLike) -> None:
    """Load the model weights (and balancing biases) of a checkpoint into ``model`` in place."""
    from megatron.core import dist_checkpointing

    path = step_dir(ckpt_dir)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(path))
    model.load_state_dict(state["model"])
