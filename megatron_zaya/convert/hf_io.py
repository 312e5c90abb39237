"""Reading and writing Hugging Face checkpoint directories (``config.json`` + safetensors)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..errors import ConversionError

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def read_hf_config(hf_dir: str | os.PathLike) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConversionError(f"{hf_dir} has no config.json: not a Hugging Face checkpoint directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConversionError(f"{path} is not valid JSON ({error.msg} at line {error.lineno})") from error


def read_hf_weights(hf_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a single-file or sharded safetensors checkpoint (or a ``pytorch_model.bin``)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(hf_dir)
    if (root / INDEX).is_file():
        files = sorted(set(json.loads((root / INDEX).read_text())["weight_map"].values()))
    elif (root / WEIGHTS).is_file():
        files = [WEIGHTS]
    elif (root / "pytorch_model.bin").is_file():
        return torch.load(root / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ConversionError(f"{hf_dir} has no {WEIGHTS}, {INDEX} or pytorch_model.bin")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        if not (root / name).is_file():
            raise ConversionError(f"{root / name} is listed in {INDEX} but missing")
        try:
            weights.update(load_file(root / name))
        except (SafetensorError, OSError) as error:
            raise ConversionError(f"{root / name} is not a readable safetensors file ({error})") from error
    return weights


def write_hf_checkpoint(out_dir: str | os.PathLike, config: dict, weights: dict[str, torch.Tensor]) -> None:
    """Write ``config.json`` and ``model.safetensors`` (a tied LM head is stored once, as HF does)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if config.get("tie_word_embeddings", True):
        weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    save_file({k: v.contiguous() for k, v in weights.items()}, out / WEIGHTS, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
