"""``zaya-pretrain`` (also ``python -m megatron_zaya.pretrain``): Megatron's ``pretrain()`` for ZAYA1.

Every ``pretrain_gpt`` flag works unchanged; ZAYA1 adds ``--zaya-*`` flags and presets. With no data flag
the run uses the embedded corpus and tokenizer (the "main job": the ``tiny`` preset, a few hundred steps,
a checkpoint, a loss-curve PNG). Examples::

    zaya-pretrain                                              # the embedded main job (CPU or GPU)
    zaya-torchrun --nproc-per-node 8 -m megatron_zaya.pretrain --zaya-preset zaya1-8b \\
        --data-path /data/corpus_text_document --tokenizer-type HuggingFaceTokenizer \\
        --tokenizer-model google/gemma-3-4b-pt --seq-length 4096 --micro-batch-size 1 \\
        --global-batch-size 512 --train-iters 100000 --lr 2e-3 --bf16 --save ckpt --load ckpt
"""

from __future__ import annotations

import atexit
import gc
import os
import sys


def _relaunch_on_all_gpus(argv: list[str]) -> None:
    """Started without a launcher on a machine with several GPUs: re-run under zaya-torchrun on all of them."""
    import torch

    if torch.cuda.device_count() > 1 and "WORLD_SIZE" not in os.environ:
        command = [sys.executable, "-m", "megatron_zaya.launch", "--standalone",
                   f"--nproc-per-node={torch.cuda.device_count()}", "-m", "megatron_zaya.pretrain", *argv]
        os.execv(sys.executable, command)


def _before_megatron(argv: list[str]) -> None:
    """The patches that must apply before Megatron is imported (``patches.startup.COMPILE_DISABLED``), where the
    selection (``--zaya-patches`` as given, else ``ZAYA_PATCHES``) holds them; the start-up log lists them. A
    selection that does not resolve is left to the command's own check, which names the problem."""
    from .errors import PatchError
    from .patches import apply_patches
    from .patches.registry import resolve
    from .patches.startup import COMPILE_DISABLED
    from .runtime import START_LOG

    selection = None
    for i, arg in enumerate(argv):  # no parser yet: Megatron's needs Megatron
        if arg.startswith("--zaya-patches="):
            selection = arg.split("=", 1)[1]
        elif arg == "--zaya-patches" and i + 1 < len(argv):
            selection = argv[i + 1]
    try:
        selected = {patch.id for patch in resolve(selection)[0]}
    except PatchError:
        return
    if COMPILE_DISABLED in selected:
        apply_patches(COMPILE_DISABLED, log=START_LOG.append)


def main(argv: list[str] | None = None) -> int:
    from .runtime import is_rank_0, one_line_for_missing_packages

    argv = list(sys.argv[1:] if argv is None else argv)
    _before_megatron(argv)
    with one_line_for_missing_packages():  # what the command imports: Megatron's training stack
        from .errors import USAGE_EXIT_CODE, CrashLoop, TrainingFault, UnhealthyNode, UsageError
        from .training import ledger
        from .training.arguments import early_flags
        from .training.command import run
        from .training.health import UNHEALTHY_NODE_EXIT_CODE
        from .training.reliability import FAULT_EXIT_CODE
    if early_flags(argv).zaya_memory_plan is None:  # a memory plan is for the world size it names
        _relaunch_on_all_gpus(argv)
    first_rank = is_rank_0()
    try:
        run(argv)
    except UsageError as error:
        print(f"zaya-pretrain: error: {error}", file=sys.stderr)
        return USAGE_EXIT_CODE
    except CrashLoop as error:  # every rank read the same ledger: one of them says it
        if first_rank:
            print(f"zaya-pretrain: error: {error}", file=sys.stderr, flush=True)
        return ledger.CRASH_LOOP_EXIT_CODE
    except TrainingFault as error:  # on every rank: one write, so that ranks sharing a pipe do not interleave
        sys.stderr.write(f"zaya-pretrain: error: {error}\n")
        sys.stderr.flush()
        return UNHEALTHY_NODE_EXIT_CODE if isinstance(error, UnhealthyNode) else FAULT_EXIT_CODE
    finally:
        if first_rank and ledger.LEDGER.path and ledger.LEDGER.path.is_file():
            print(ledger.summary(ledger.LEDGER.events(), ledger.LEDGER.path), flush=True)
    return 0


def cli() -> None:
    """The ``zaya-pretrain`` command: :func:`main`, with an exit that skips Python's final garbage collection,
    which would walk every object of torch, Megatron and transformers (about 3 s per process). Registered
    first, the freeze runs after every other exit handler (those that shut down data-loader workers and
    checkpoint writers look for live objects); objects left in reference cycles then go with the process."""
    atexit.register(gc.freeze)
    sys.exit(main())


if __name__ == "__main__":
    cli()
