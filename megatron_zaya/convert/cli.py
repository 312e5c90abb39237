"""``zaya-convert``: ZAYA1 checkpoints between Hugging Face and Megatron ``torch_dist``.

    zaya-convert import-hf HF_DIR OUT_DIR        # -> Megatron checkpoint (loads with zaya-pretrain --load)
                                                 #    HF_DIR: ZAYA1-8B (transformers) or ZAYA1-base (Zyphra fork) layout
    zaya-convert export-hf CKPT_DIR OUT_HF_DIR   # -> transformers.AutoModelForCausalLM.from_pretrained(OUT_HF_DIR)

Bad input stops with a one-line error and exit code 2 before anything is written; the output is built in a
temporary directory beside its destination and renamed into place only when complete, with the permissions
of any new directory (the umask's). An export takes the tokenizer's own files only (as the tokenizer saves
itself), and says so when it has none.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from megatron_zaya.errors import USAGE_EXIT_CODE, CheckpointError, ConversionError, UsageError

DTYPES = {"auto": None, "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # torch's names: --help needs no torch


def _check_output(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"output {out} exists and is not empty; choose a new directory (nothing was overwritten)")


def _staging(out: Path) -> Path:
    """A fresh directory to write into before it becomes ``out``, in ``out``'s nearest existing ancestor (directories
    still missing are made only when it is published); made before the model loads, so that an output that cannot
    be written fails at once."""
    ancestor = next(path for path in (out.parent, *out.parent.parents) if path.exists())
    try:
        return Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=ancestor))
    except OSError as error:  # (also where os.access would say yes: root, a place that takes no files such as /proc)
        raise UsageError(f"output {out} cannot be written ({error.strerror or error}); choose another "
                         "directory") from error


def _write_failed(out: Path, staging: Path, error: BaseException) -> UsageError:
    """The one line for a conversion whose write into ``staging`` failed as ``error``: want of room named as such."""
    from megatron_zaya.checkpoint.save_failures import write_failure

    return UsageError(f"writing {out} failed ({write_failure(error, staging)}); free space or choose another "
                      "directory (nothing was written)")


def _publish(staging: Path, out: Path) -> None:
    from megatron_zaya.checkpoint import publish_permissions

    publish_permissions(staging)
    if out.exists():
        out.rmdir()  # empty, checked before
    out.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(out)


def _load_tokenizer(tokenizer: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(tokenizer))
    except (OSError, ValueError) as error:
        raise UsageError(f"--tokenizer {tokenizer} holds no tokenizer transformers can load "
                         f"({str(error).splitlines()[0]}); give the tokenizer's directory") from error


def import_hf(hf_dir: Path, out: Path, dtype) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_zaya import checkpoint
    from megatron_zaya.pretrained import load_hf

    _check_output(out)
    staging = _staging(out)
    try:
        model, cfg = load_hf(hf_dir, dtype)
        try:
            checkpoint.save(model, cfg, staging)
        except (OSError, CheckpointException) as error:  # a full disk (Megatron's writer hides the cause)
            raise _write_failed(out, staging, error) from error
        _publish(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"wrote Megatron torch_dist checkpoint {out} ({cfg.num_layers} layers, {cfg.num_moe_experts} experts); "
          f"fine-tune it (on the embedded corpus; for your data add --data-path PREFIX --tokenizer-type "
          f"HuggingFaceTokenizer --tokenizer-model {hf_dir}) with:\n  {shlex.join(finetune_command(cfg, out))}")


def finetune_command(cfg, ckpt: Path) -> list[str]:
    """A zaya-pretrain command that fine-tunes the imported checkpoint: its preset, or flags of its shape."""
    from megatron_zaya.config import PRESETS, architecture, zaya_config
    from megatron_zaya.training.arguments import shape_flags

    same = [name for name in PRESETS if architecture(zaya_config(name)) == architecture(cfg)]
    shape = next(iter(PRESETS.values()))
    model = ["--zaya-preset", same[0]] if same else shape_flags({field: getattr(cfg, field) for field in shape})
    return [sys.executable, "-m", "megatron_zaya.pretrain", *model, "--load", str(ckpt), "--finetune",
            "--save", f"{ckpt}-finetuned", "--save-interval", "1000", "--train-iters", "1000", "--lr", "1e-5",
            "--min-lr", "1e-6"]


def export_hf(ckpt_dir: Path, out: Path, dtype, tokenizer: Path | None) -> None:
    import torch
    from safetensors import SafetensorError

    from megatron_zaya.convert.hf import hf_config_from_zaya, megatron_to_hf
    from megatron_zaya.convert.hf_io import write_hf_checkpoint
    from megatron_zaya.pretrained import load_megatron

    _check_output(out)
    if tokenizer is not None and not tokenizer.is_dir():
        raise UsageError(f"--tokenizer {tokenizer} is not a directory")
    loaded_tokenizer = _load_tokenizer(tokenizer) if tokenizer is not None else None
    staging = _staging(out)
    try:
        model, cfg = load_megatron(ckpt_dir, dtype)
        hf_config = hf_config_from_zaya(cfg)
        hf_config["dtype"] = str(cfg.params_dtype).removeprefix("torch.")
        state = {k: v.detach().cpu() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        weights = megatron_to_hf(state, cfg)
        try:
            write_hf_checkpoint(staging, hf_config, weights)
            if loaded_tokenizer is not None:
                loaded_tokenizer.save_pretrained(str(staging))  # its own files, not the rest of its directory
        except (OSError, SafetensorError) as error:  # a full disk (safetensors reports it as its own error)
            raise _write_failed(out, staging, error) from error
        _publish(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"wrote Hugging Face checkpoint {out}; load it with "
          f"transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    if tokenizer is None:
        print(f"zaya-convert: warning: {out} has no tokenizer; export again with --tokenizer DIR (the tokenizer the "
              "model was trained with) or save that tokenizer into it", file=sys.stderr)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zaya-convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import-hf", help="Hugging Face directory -> Megatron torch_dist checkpoint")
    imp.add_argument("hf_dir", type=Path)
    imp.add_argument("out_dir", type=Path)
    exp = sub.add_parser("export-hf", help="Megatron checkpoint -> Hugging Face directory")
    exp.add_argument("ckpt_dir", type=Path)
    exp.add_argument("out_dir", type=Path)
    exp.add_argument("--tokenizer", type=Path, default=None, help="copy these tokenizer files into the output")
    for sp in (imp, exp):
        sp.add_argument("--dtype", choices=DTYPES, default="auto", help="weights dtype (auto: keep the source's)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)  # before torch and Megatron: --help and usage errors come at once
    from megatron_zaya.runtime import one_line_for_missing_packages

    with one_line_for_missing_packages():
        import torch

        from megatron_zaya.pretrained import load_hf  # noqa: F401  (Megatron's model stack)

    dtype = None if DTYPES[args.dtype] is None else getattr(torch, DTYPES[args.dtype])
    try:
        if args.command == "import-hf":
            import_hf(args.hf_dir, args.out_dir, dtype)
        else:
            export_hf(args.ckpt_dir, args.out_dir, dtype, args.tokenizer)
    except (ConversionError, CheckpointError, UsageError) as error:
        print(f"zaya-convert: error: {error}", file=sys.stderr)
        return USAGE_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
