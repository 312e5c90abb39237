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
import shlex
import sys
from pathlib import Path

APPLIED = ("applied", "already applied")  # apply_patches() reports of a patch in effect

# The peak learning rate of a run that gives no --lr (Megatron has no default; its optimizers fail without one):
# ZAYA1's default recipe, docs/architecture.md ("learning-rate schedule").
DEFAULT_LR = "2e-3"

EMBEDDED_RUN_DIR = "runs/zaya-tiny"
EMBEDDED_DATA_DIR = "runs/embedded-data"  # the embedded corpus tokenised, once

# Training flags of the embedded main job (prepended: any explicit flag wins).
# The balancing-bias lr is 10x the pretraining default so that 300 steps show the experts evening out.
MAIN_JOB_FLAGS = [
    "--seq-length", "128", "--micro-batch-size", "8", "--global-batch-size", "8", "--train-iters", "300",
    "--zaya-balancing-lr", "1e-2",
    "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "20",
    "--weight-decay", "0.1", "--clip-grad", "1.0", "--log-interval", "10", "--eval-interval", "100",
    "--eval-iters", "2", "--split", "98,2,0", "--seed", "1234", "--save-interval", "300",
]


def _flag_value(argv: list[str], flag: str) -> str | None:
    value = None
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif token.startswith(flag + "="):
            value = token.split("=", 1)[1]
    return value


def _has(argv: list[str], *flags: str) -> bool:
    return any(t == f or t.startswith(f + "=") for t in argv for f in flags)


def build_argv(argv: list[str], cuda: bool) -> list[str]:
    """ZAYA1's flags, the preset's, platform and main-job defaults, then the user's (last wins)."""
    from .config import PRESETS, preset
    from .training.arguments import ZAYA_FLAGS, UsageError, preset_flags
    from .training.checkpoint_tiers import implied_flags

    name = _flag_value(argv, "--zaya-preset") or "tiny"  # explicit model flags override its values
    if name not in PRESETS:
        raise UsageError(f"unknown preset {name!r} for --zaya-preset; choose one of {', '.join(PRESETS)}")
    if _has(argv, "--vocab-size") and _flag_value(argv, "--tokenizer-type") != "NullTokenizer":
        raise UsageError("--vocab-size sets the vocabulary of Megatron's NullTokenizer only; the model's vocabulary "
                         "is --zaya-vocab-size N")
    flags = list(ZAYA_FLAGS) + preset_flags(name)
    # Non-finite steps are skipped by the reliability.step_guard patch on every rank; Megatron's own check
    # would instead abort (or rerun the step and exit 16) from inside the backward pass.
    flags += ["--no-check-for-nan-in-loss-and-grad"]
    flags += [] if cuda else ["--distributed-backend", "gloo", "--use-cpu-initialization"]
    flags += implied_flags(argv)  # --async-save alone: a background save
    flags += ["--lr", DEFAULT_LR]

    if _has(argv, "-h", "--help"):
        pass  # only the flags are printed: no embedded corpus to build
    elif not _has(argv, "--data-path", "--mock-data", "--train-data-path", "--data-args-path"):
        from .data import embedded_tokenizer_dir
        from .data.preprocess import embedded_dataset_prefix

        flags += MAIN_JOB_FLAGS + (["--bf16"] if cuda else [])
        iterations = _flag_value(argv, "--train-iters")
        if iterations and iterations.isdigit():  # a shorter job: a warmup that fits in it (a tenth, at most 20)
            flags += ["--lr-warmup-iters", str(min(20, int(iterations) // 10))]
        flags += ["--save", _flag_value(argv, "--save") or EMBEDDED_RUN_DIR]
        flags += ["--data-path", embedded_dataset_prefix(EMBEDDED_DATA_DIR, build=False),
                  "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", embedded_tokenizer_dir()]
    elif _has(argv, "--mock-data") and not _has(argv, "--tokenizer-type"):
        vocab = _flag_value(argv, "--zaya-vocab-size") or preset(name)["vocab_size"]
        flags += ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(int(vocab) - 1)]  # + the EOD token
    tp = _flag_value(argv, "--tensor-model-parallel-size")
    if tp and tp.isdigit() and int(tp) > 1 and not _has(argv, "--sequence-parallel"):
        # Megatron's MoE layer trains under tensor parallelism only with sequence parallelism (moe_layer.py:629)
        flags += ["--sequence-parallel"]
        if os.environ.get("RANK", "0") == "0":
            print(f"[zaya] --tensor-model-parallel-size {tp} with ZAYA1's experts needs sequence parallelism: added "
                  "--sequence-parallel", flush=True)
    given = _flag_value(argv, "--save")  # `--save ""`: no checkpoints, even for the main job
    save = given if given is not None else _flag_value(flags, "--save")
    if save and not _has(argv, "--load", "--zaya-overwrite-save"):
        # A run resumes where it saves (Megatron starts afresh from a directory without a checkpoint).
        flags += ["--load", save]
    if _saves_on_sigterm(argv, flags):
        flags += ["--exit-signal-handler"]  # Megatron's save-on-SIGTERM; the deadline bounds it
    return flags + argv


def _memory_plan_world_size(argv: list[str]) -> int | None:
    """``--zaya-memory-plan [N]``: N, else the launcher's world size, else 1; None without the flag."""
    if not _has(argv, "--zaya-memory-plan"):
        return None
    value = _flag_value(argv, "--zaya-memory-plan")
    if value is None or value.startswith("-"):
        return int(os.environ.get("WORLD_SIZE", "1"))
    if not value.isdigit() or int(value) < 1:
        from .training.arguments import UsageError

        raise UsageError(f"--zaya-memory-plan {value}: give a number of GPUs >= 1, or nothing")
    return int(value)


# Flags that name data: (flag, number of values; None: every value up to the next flag).
DATA_FLAGS = {"--data-path": None, "--train-data-path": None, "--valid-data-path": None, "--test-data-path": None,
              "--data-args-path": 1, "--per-split-data-args-path": 1, "--tokenizer-type": 1, "--tokenizer-model": 1}


def _planned_argv(argv: list[str]) -> list[str]:
    """The command a memory plan builds: its data and tokenizer files may exist only on the cluster, and the plan
    needs neither (the vocabulary is the model's, --zaya-vocab-size or the preset's), so --mock-data stands in."""
    if not _has(argv, *DATA_FLAGS):
        return argv  # the main job, on the embedded corpus
    kept, skip_values = [], 0
    for token in argv:
        flag = token.split("=", 1)[0]
        if flag in DATA_FLAGS:
            skip_values = 0 if "=" in token else (DATA_FLAGS[flag] or -1)
        elif skip_values and not token.startswith("--"):
            skip_values -= 1
        else:
            skip_values = 0
            kept.append(token)
    return kept + ["--mock-data"]


def _saves_on_sigterm(argv: list[str], flags: list[str]) -> bool:
    """With a --save directory, SIGTERM (pre-emption, scancel) saves unless --zaya-sigterm-deadline is 0."""
    deadline = _flag_value(argv, "--zaya-sigterm-deadline")
    try:
        off = deadline is not None and float(deadline) <= 0
    except ValueError:
        return False  # argparse names the bad value
    return not off and (_has(argv, "--save") or _has(flags, "--save"))


def _relaunch_on_all_gpus(argv: list[str]) -> None:
    """Started without a launcher on a machine with several GPUs: re-run under zaya-torchrun on all of them."""
    import torch

    if torch.cuda.device_count() > 1 and "WORLD_SIZE" not in os.environ:
        command = [sys.executable, "-m", "megatron_zaya.launch", "--standalone",
                   f"--nproc-per-node={torch.cuda.device_count()}", "-m", "megatron_zaya.pretrain", *argv]
        os.execv(sys.executable, command)


def _parse(argv: list[str], planning: bool = False):
    """Megatron's argument parsing with ZAYA1's flags; our checks first, so that bad input fails in one line.
    ``planning``: a memory plan, for a cluster; what this machine lacks is not refused."""
    from megatron.training.arguments import parse_and_validate_args, parse_args
    from megatron.training.global_vars import get_tokenizer

    from .data.preprocess import embedded_dataset_prefix
    from .training.arguments import UsageError, add_zaya_args, check_args, check_data

    sys.argv = ["zaya-pretrain", *argv]
    flags = parse_args(add_zaya_args)
    check_args(flags, int(os.environ.get("WORLD_SIZE", "1")), machine_checks=not planning)
    main_job = embedded_dataset_prefix(EMBEDDED_DATA_DIR, build=False) in (flags.data_path or [])
    if not main_job:
        check_data(flags)
    if flags.save and flags.save_interval is None:  # after the data checks, whose errors say more
        raise UsageError("--save needs --save-interval N, the steps between checkpoints (a checkpoint is also saved "
                         "at the end of the run and on SIGTERM)")
    try:
        args = parse_and_validate_args(add_zaya_args)
    except AssertionError as error:
        raise UsageError(f"invalid arguments: {str(error) or _failed_check(error)}") from error
    except ValueError as error:  # Megatron's tokenizer builder wraps what transformers raised
        if not str(error).startswith("Unable to instantiate HuggingFace AutoTokenizer"):
            raise
        reason = str(error).split("Exception: ", 1)[-1].strip().splitlines()[0]
        raise UsageError(f"--tokenizer-model {_flag_value(argv, '--tokenizer-model')} does not load ({reason}); give "
                         "the tokenizer's directory, or a Hugging Face name that is downloaded or reachable") from error
    tokenizer_vocab = get_tokenizer().vocab_size
    model_vocab = args.zaya_vocab_size or args.padded_vocab_size
    if tokenizer_vocab > model_vocab:
        raise UsageError(f"the tokenizer has {tokenizer_vocab} tokens but the model's vocabulary is {model_vocab}; "
                         "use a tokenizer that fits or raise --zaya-vocab-size")
    args.padded_vocab_size = model_vocab
    if main_job:  # the embedded corpus is tokenised once the flags are known to be sound
        embedded_dataset_prefix(EMBEDDED_DATA_DIR)
        check_data(args)
    return args


def _failed_check(error: AssertionError) -> str:
    """Megatron's bare ``assert``s carry no message: name the check that failed instead."""
    import traceback

    return f"Megatron's check `{traceback.extract_tb(error.__traceback__)[-1].line}` failed"


def run(argv: list[str]) -> None:
    import torch

    from .patches import apply_patches
    from .patches.registry import PatchError
    from .patches.registry import check_selection as check_patch_selection
    from .runtime import START_LOG, end_data_workers_at_exit, end_helpers_with_this_process, write_start_log
    from .training.arguments import UsageError

    end_helpers_with_this_process()  # no helper outlives a killed trainer
    end_data_workers_at_exit()  # nor waits forever on data-loader workers at exit
    cuda = torch.cuda.is_available()
    user_argv = argv  # as given: the command that resumes is printed from it
    plan_size = _memory_plan_world_size(argv)
    if plan_size is not None:  # the plan is for GPUs and for the world size asked, whatever this machine is
        cuda = True
        os.environ["WORLD_SIZE"] = str(plan_size)
        argv = _planned_argv(argv)
    user_argv, argv = argv, build_argv(argv, cuda)
    selection = _flag_value(argv, "--zaya-patches")
    try:  # unknown names, the cpu group left out on a CPU, a kernel patch asked for that cannot apply here
        check_patch_selection(selection, needs_cpu_group=not cuda)
        patches = apply_patches(selection, log=START_LOG.append)
    except PatchError as error:
        raise UsageError(str(error)) from error
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # a single process without a launcher
        from .runtime import free_master_port

        os.environ["MASTER_PORT"] = str(free_master_port(os.environ["MASTER_ADDR"]))
    # Megatron requires it with TP or CP (one hardware queue keeps communication kernels in launch order), as its
    # example scripts export; set before the first CUDA context.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    from .training import reliability, save_dir
    from .training.loss_curve import LOSS_CURVE
    from .training.steps import forward_step, model_provider, train_valid_test_datasets_provider

    args = _parse(argv, planning=plan_size is not None)
    if args.pipeline_model_parallel_size > 1 and patches.get("pipeline.stage_tensor_width") not in APPLIED:
        raise UsageError("pipeline parallelism needs the pipeline.stage_tensor_width patch (stages exchange hidden + "
                         "router-state channels); add it to --zaya-patches")
    if plan_size is not None:
        from . import memory_plan

        print(memory_plan.report(*memory_plan.from_args(args)), flush=True)
        return
    resuming = save_dir.check_save_and_load(args, user_argv)
    if args.save:
        reliability.check_save_dir(args.save)
        save_dir.lock_save_dir(args.save, args.zaya_save_lock_stale_after)
        if int(os.environ.get("RANK", "0")) == 0:  # one rank deletes, and says what happens
            line = save_dir.remove_checkpoints(args.save) if args.zaya_overwrite_save else resuming
            if line:
                print(line, flush=True)
    write_start_log(args.save, sum(state == "applied" for state in patches.values()), len(patches))
    if args.exit_signal_handler and args.save and args.zaya_sigterm_deadline > 0:
        reliability.arm_sigterm_deadline(args.zaya_sigterm_deadline, args.save)
    plot = args.zaya_loss_plot or (str(Path(args.save) / "loss.png") if args.save else None)
    LOSS_CURVE.enabled = plot is not None
    try:
        pretrain(pretrain_cfg_container_from_args(args, None), train_valid_test_datasets_provider,
                 ModelType.encoder_or_decoder, reliability.GUARD.watch(forward_step), model_provider=model_provider)
    except SystemExit as stop:  # --exit-interval, --exit-duration-in-mins, SIGTERM: the curve so far is kept too
        if stop.code in (None, 0):
            _finish(args, user_argv, plot, stopped_early=True)
        raise
    _finish(args, user_argv, plot)


# Flags of a finished run that its continuation replaces (the number of values each takes).
_NOT_CONTINUED = {"--train-iters": 1, "--load": 1, "--save": 1, "--finetune": 0, "--override-opt_param-scheduler": 0,
                  "--use-checkpoint-opt_param-scheduler": 0}


def continue_command(args, user_argv: list[str]) -> list[str]:
    """The command that trains a finished run on to twice its steps on the schedule it finished (the learning rate
    stays where the schedule ended): this run's flags, resumed from its checkpoint."""
    kept, skip = [], 0
    for token in user_argv:
        if skip:
            skip -= 1
        elif token.split("=", 1)[0] in _NOT_CONTINUED:
            skip = 0 if "=" in token else _NOT_CONTINUED[token]
        else:
            kept.append(token)
    return [sys.executable, "-m", "megatron_zaya.pretrain", *kept, "--train-iters", str(2 * args.train_iters),
            "--load", args.save, "--save", args.save, "--use-checkpoint-opt_param-scheduler"]


def export_command(args) -> list[str]:
    """The command that converts the run's checkpoint to Hugging Face, with the tokenizer it trained with."""
    tokenizer = args.tokenizer_model if args.tokenizer_model and Path(args.tokenizer_model).is_dir() else None
    return [sys.executable, "-m", "megatron_zaya.convert.cli", "export-hf", args.save, f"{args.save}-hf",
            *(["--tokenizer", tokenizer] if tokenizer else [])]


def _finish(args, user_argv: list[str], plot: str | None, stopped_early: bool = False) -> None:
    """On the rank that computed losses (last stage, first DP, CP and TP rank): the plot and what to run next
    (after an early stop, the plot and the command that resumes)."""
    from megatron.core import parallel_state as mpu

    from .training.loss_curve import LOSS_CURVE

    if plot:  # every rank: each holds the losses of its share of the batch
        LOSS_CURVE.pool(mpu.get_data_parallel_group(with_context_parallel=True))
    if not (mpu.is_pipeline_last_stage() and mpu.get_data_parallel_rank() == 0
            and mpu.get_context_parallel_rank() == 0 and mpu.get_tensor_model_parallel_rank() == 0):
        return
    lines = []
    if plot and LOSS_CURVE.points():
        lines.append(f"loss curve: {LOSS_CURVE.write(plot)}")
    if stopped_early:
        from .training.reliability import describe_latest_checkpoint
        from .training.save_dir import resume_command

        then = (f"the last checkpoint: {describe_latest_checkpoint(args.save)}; resume with: "
                f"{resume_command(user_argv, args.save)}" if args.save else "nothing saved (no --save)")
        print(f"[zaya] stopped early; {'; '.join(lines) or 'no loss curve'}; {then}", flush=True)
        return
    if args.save:
        lines += [f"checkpoint: {args.save}", f"continue training: {shlex.join(continue_command(args, user_argv))}",
                  f"convert to Hugging Face: {shlex.join(export_command(args))}"]
    if lines:
        print("\n[zaya] done.\n  " + "\n  ".join(lines), flush=True)


def main(argv: list[str] | None = None) -> int:
    from .runtime import one_line_for_missing_packages

    argv = list(sys.argv[1:] if argv is None else argv)
    with one_line_for_missing_packages():  # what run() imports: Megatron's training stack
        import megatron.training.training  # noqa: F401

        from .training.arguments import UsageError
        from .training.reliability import FAULT_EXIT_CODE, TrainingFault
        from .training.steps import forward_step  # noqa: F401
    if not _has(argv, "--zaya-memory-plan"):
        _relaunch_on_all_gpus(argv)
    try:
        run(argv)
    except UsageError as error:
        print(f"zaya-pretrain: error: {error}", file=sys.stderr)
        return 2
    except TrainingFault as error:  # on every rank: one write, so that ranks sharing a pipe do not interleave
        sys.stderr.write(f"zaya-pretrain: error: {error}\n")
        sys.stderr.flush()
        return FAULT_EXIT_CODE
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
