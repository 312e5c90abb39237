"""What a run checks of the checkpoint it loads, once the verified load has chosen it (so that no damaged file is
read): the model's architecture, the optimizer whose state it holds and the tokenizer it was trained with. A
mismatch stops the run in one line (exit 2) before training, instead of a shape error, a traceback from the
optimizer's state or a silent change of what the token ids mean.
"""

from __future__ import annotations

import hashlib
import json

from ..errors import UsageError
from ..runtime import is_rank_0
from ..training.arguments import field_flag, zaya_config_from_args
from .model_io import architecture_differences


def tokenizer_identity(tokenizer, args) -> dict:
    """What fixes the meaning of the token ids: the vocabulary (each id's token) and the end-of-document id, as a
    digest, with the vocabulary's size and the tokenizer's name for the message. The same tokenizer at another
    path has the same identity."""
    try:
        vocab = tokenizer.vocab
    except Exception:  # NullTokenizer (mock data: the ids are the tokens), or one that cannot list its vocabulary
        vocab = None
    if isinstance(vocab, dict):
        vocab = sorted(vocab.items(), key=lambda item: item[1])
    text = json.dumps([vocab, getattr(tokenizer, "eod", None)], default=repr)
    return {"name": args.tokenizer_model or args.tokenizer_type, "vocab_size": tokenizer.vocab_size,
            "digest": hashlib.sha256(text.encode()).hexdigest()[:16]}


def _described(identity: dict) -> str:
    return f"{identity['name']}, {identity['vocab_size']} tokens, digest {identity['digest']}"


# Architecture fields that the next stage of a run may change: no weight depends on them. The positions follow
# the sequence length freely; a new RoPE base changes what the weights see, so it takes a flag.
STAGE_FIELDS = ("max_position_embeddings",)
ROTARY_FIELDS = ("rotary_base", "sliding_rotary_base")


def check_checkpoint_fits(saved, load: str, release: bool, args) -> None:
    """Raise :class:`UsageError`, naming every mismatch and its fix in one line, if the checkpoint of ``load``
    whose saved ``args`` are ``saved`` cannot be loaded into this run as its flags stand (``args``). A field that
    a checkpoint does not record (older or converted checkpoints) is not checked."""
    problems = []
    differences = [difference for difference in architecture_differences(
        getattr(saved, "zaya_architecture", None) or {}, zaya_config_from_args(args))
        if difference[0] not in STAGE_FIELDS]  # fmt: skip
    rotary = [difference for difference in differences if difference[0] in ROTARY_FIELDS]
    if rotary and args.zaya_allow_rotary_base_change:
        differences = [difference for difference in differences if difference not in rotary]
        if is_rank_0():
            print(f"[zaya] --load {load}: " + "; ".join(f"{field_flag(field)} changes from {saved:g} to {ours:g}"
                                                        for field, saved, ours in rotary), flush=True)
    elif rotary and differences == rotary:
        named = "; ".join(f"{field_flag(field)} {saved:g} in the checkpoint, {ours:g} here"
                          for field, saved, ours in rotary)
        problems.append(f"it was trained with another RoPE base ({named}); add --zaya-allow-rotary-base-change if the "
                        "new base is meant (a context extension), or give the checkpoint's")
        differences = []
    if differences:
        named = "; ".join(f"{field_flag(field)}: {saved!r} in the checkpoint, {ours!r} here"
                          for field, saved, ours in differences)
        problems.append(f"it holds a different model ({named}); give the flags it was trained with, or another --load")
    loads_optimizer = not (release or args.finetune or args.no_load_optim or getattr(saved, "no_save_optim", False))
    optimizer = getattr(saved, "optimizer", None)
    if loads_optimizer and optimizer is not None and optimizer != args.optimizer:
        problems.append(f"it holds the state of --optimizer {optimizer}, but this run uses --optimizer "
                        f"{args.optimizer}; add --no-load-optim to start {args.optimizer} afresh from the "
                        f"checkpoint's weights, or resume with --optimizer {optimizer}")
    tokenizer, ours = getattr(saved, "zaya_tokenizer", None), args.zaya_tokenizer
    if tokenizer is not None and not args.zaya_allow_tokenizer_change and (
            tokenizer["vocab_size"], tokenizer["digest"]) != (ours["vocab_size"], ours["digest"]):
        problems.append(f"it was trained with another tokenizer ({_described(tokenizer)}; this run's: "
                        f"{_described(ours)}); give the tokenizer it was trained with, or add "
                        "--zaya-allow-tokenizer-change if the new one is meant (each token id keeps its embedding)")
    if problems:
        raise UsageError(f"--load {load}: {'. And '.join(problems)}")
