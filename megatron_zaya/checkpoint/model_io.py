"""A ZAYA1 model in a checkpoint outside ``megatron.training``: the training arguments and architecture a step
records, and the save and load of a model held by one process (``zaya-convert``, ``load_pretrained``).

A step's common state has ``args`` (the training arguments, with ``args.zaya_architecture``: the
:data:`~megatron_zaya.config.ARCHITECTURE_FIELDS` of the model), the iteration and the checkpoint version; its
sharded state has ``model`` (and, from training, the optimizer).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..config import ARCHITECTURE_FIELDS, ZayaConfig, architecture, zaya_config
from ..errors import CheckpointError, ZayaConfigError
from .format import TRACKER, publish_permissions, write_checksums


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
