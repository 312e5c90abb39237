"""``load_pretrained``: a ready ZAYA1 model in this process from an HF directory or a Megatron checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .checkpoint import TRACKER
from .config import ZayaConfig, zaya_config
from .convert.hf import hf_to_megatron, zaya_kwargs_from_hf
from .convert.hf_base import base_weights_to_hf, is_base_layout
from .convert.hf_io import read_hf_config, read_hf_weights
from .errors import ConversionError, ZayaConfigError

# Single-process use: nothing to dispatch across ranks, so the simplest dispatcher serves.
_RUNTIME = dict(use_cpu_initialization=True, moe_token_dispatcher_type="allgather")


def _floating_dtype(weights: dict[str, torch.Tensor]) -> torch.dtype:
    return weights["model.embed_tokens.weight"].dtype


def build_single_process_model(cfg: ZayaConfig):
    from .model import build_zaya_model
    from .runtime import ensure_single_process_parallel_state

    ensure_single_process_parallel_state()
    return build_zaya_model(cfg)  # TP = 1: the logits are whole


def load_hf(hf_dir: str | os.PathLike, dtype: torch.dtype | None = None):
    """Build a ZayaModel from a ``transformers`` ZAYA1 directory; returns ``(model, config)``."""
    hf_config = read_hf_config(hf_dir)
    kwargs = zaya_kwargs_from_hf(hf_config)
    weights = read_hf_weights(hf_dir)
    if is_base_layout(hf_config):
        weights = base_weights_to_hf(weights, hf_config)
    dtype = dtype or _floating_dtype(weights)
    try:
        cfg = zaya_config(**kwargs, **_RUNTIME, params_dtype=dtype, bf16=dtype == torch.bfloat16)
    except ZayaConfigError as error:
        raise ConversionError(f"{hf_dir}/config.json describes an invalid ZAYA1 model: {error}") from error
    state = hf_to_megatron(weights, cfg)
    model = build_single_process_model(cfg)
    expected = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    for key, tensor in state.items():
        if key not in expected:
            raise ConversionError(f"converted tensor {key} has no place in the model")
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise ConversionError(f"{key}: checkpoint shape {tuple(tensor.shape)} != model shape "
                                  f"{tuple(expected[key].shape)} from config.json")
    with torch.no_grad():
        for key, param in expected.items():
            if key in state:
                param.copy_(state[key])
    return model, cfg


def load_megatron(ckpt_dir: str | os.PathLike, dtype: torch.dtype | None = None):
    """Build a ZayaModel from the latest step of a megatron-zaya ``torch_dist`` checkpoint, once its files match
    the checksums recorded at save (:class:`~megatron_zaya.errors.CheckpointError` if not); returns
    ``(model, config)``."""
    from . import checkpoint

    step = checkpoint.verified_step(ckpt_dir)
    cfg = checkpoint.read_config(step, **_RUNTIME, **({"params_dtype": dtype} if dtype else {}))
    model = build_single_process_model(cfg)
    checkpoint.load(model, step)
    return model, cfg


def load_pretrained(path: str | os.PathLike, dtype: torch.dtype | None = None, device: str | None = None):
    """A ZAYA1 model ready for ``model(input_ids [b, s]) -> logits [b, s, vocab]`` (eval mode); with
    ``position_ids=[b, s]``, each position 0 starts a document that sees nothing before it (packed documents).

    ``path`` is a Hugging Face directory (``config.json``) or a Megatron checkpoint directory
    (``latest_checkpointed_iteration.txt``). torch.distributed and Megatron's parallel state are set up for
    a single process when they are not already; torch's own functions are left as they were (on a CPU-only
    machine, the ``cpu`` patches of torch apply only while the model is built).
    """
    from .patches.registry import torch_as_it_was

    root = Path(path)
    if not (root / "config.json").is_file() and not (root / TRACKER).is_file():
        raise ConversionError(f"{path} is neither a Hugging Face directory (config.json) nor a Megatron "
                              f"checkpoint ({TRACKER})")
    with torch_as_it_was():  # the caller's torch keeps its own Tensor.cuda and torch.cuda.current_device
        model, _ = load_hf(root, dtype) if (root / "config.json").is_file() else load_megatron(root, dtype)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return model.to(device).eval()
