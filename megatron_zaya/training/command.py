"""One ``zaya-pretrain`` command (the CLI is ``megatron_zaya/pretrain.py``): the flags it gives Megatron, among them
the main job's (:func:`runs_main_job`), our checks before Megatron's, Megatron's ``pretrain()``, and what to run
next."""

from __future__ import annotations

import os
import re
import shlex
import sys
import traceback
from pathlib import Path

import megatron.training  # pretrain() is looked up when called: patches wrap it (checkpointing.local_tier)
import torch
from megatron.core.enums import ModelType
from megatron.training.argument_utils import pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args, parse_args
from megatron.training.global_vars import get_tokenizer

from ..checkpoint import local_tier, resume, save_lock
from ..checkpoint.format import describe_latest_checkpoint, read_tracker
from ..checkpoint.save_failures import check_save_dir
from ..checkpoint.tiers import ASYNC_FLAGS, check_host_memory, memory_tier_flags
from ..config import PRESETS, preset
from ..data import embedded_tokenizer_dir
from ..errors import CrashLoop, PatchError, UsageError
from ..memory_plan import memory_tier_host_bytes, plan as memory_plan
from ..memory_plan import report as memory_plan_report
from ..optim import OPTIMIZER_NAME, muon_config_from_args
from ..patches import apply_patches
from ..patches.registry import check_selection as check_patch_selection
from ..runtime import (START_LOG, end_data_workers_at_exit, end_helpers_with_this_process, free_master_port,
                       is_rank_0, relaunch_count, write_start_log)
from . import health, reliability
from .arguments import (ZAYA_FLAGS, add_zaya_args, check_args, check_data, early_flags, memory_plan_inputs,
                        preset_flags, zaya_config_from_args, zaya_pretrain_parser)
from .ledger import CRASH_LOOP_EXIT_CODE, LEDGER, LEDGER_FILE, failing_step, last_error_line
from .loss_curve import LOSS_CURVE, curve_group, writes_curve
from .steps import forward_step, model_provider, train_valid_test_datasets_provider
from .watchdog import record_collectives

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


def runs_main_job(early) -> bool:
    """Whether a command (its ``early_flags``) is the main job: it names no data and does not ask for --help."""
    named = (early.data_path, early.train_data_path, early.data_args_path)
    return not early.help and not early.mock_data and all(value is None for value in named)


def _main_job_flags(early, cuda: bool) -> list[str]:
    """The main job's data, tokenizer, schedule and run directory (before the user's flags)."""
    from ..data.preprocess import embedded_dataset_prefix  # here: other runs need no tokeniser (0.15 s to import)

    flags = MAIN_JOB_FLAGS + (["--bf16"] if cuda else [])
    if early.train_iters is not None:  # a shorter job: a warmup that fits in it (a tenth, at most 20)
        flags += ["--lr-warmup-iters", str(min(20, early.train_iters // 10))]
    return flags + ["--save", EMBEDDED_RUN_DIR, "--data-path", embedded_dataset_prefix(EMBEDDED_DATA_DIR, build=False),
                    "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", embedded_tokenizer_dir()]


def build_argv(argv: list[str], cuda: bool) -> list[str]:
    """ZAYA1's flags, the preset's, platform and main-job defaults, then the user's (last wins)."""
    early = early_flags(argv)
    name = early.zaya_preset or "tiny"  # explicit model flags override its values
    if name not in PRESETS:
        raise UsageError(f"unknown preset {name!r} for --zaya-preset; choose one of {', '.join(PRESETS)}")
    if early.vocab_size is not None and early.tokenizer_type != "NullTokenizer":
        raise UsageError("--vocab-size sets the vocabulary of Megatron's NullTokenizer only; the model's vocabulary "
                         "is --zaya-vocab-size N")
    flags = list(ZAYA_FLAGS) + preset_flags(name)
    # Non-finite steps are skipped by the reliability.step_guard patch on every rank; Megatron's own check
    # would instead abort (or rerun the step and exit 16) from inside the backward pass.
    flags += ["--no-check-for-nan-in-loss-and-grad"]
    flags += [] if cuda else ["--distributed-backend", "gloo", "--use-cpu-initialization"]
    flags += ASYNC_FLAGS if early.async_save else []
    flags += ["--lr", DEFAULT_LR]
    if early.zaya_gc_interval < 0:
        raise UsageError(f"--zaya-gc-interval {early.zaya_gc_interval} is negative; give a number of steps >= 0 "
                         "(0: Python's automatic collector)")
    if early.zaya_gc_interval:  # collections at step boundaries, the same step on every rank
        flags += ["--manual-gc", "--manual-gc-interval", str(early.zaya_gc_interval)]
    main_job = runs_main_job(early)
    if main_job:
        flags += _main_job_flags(early, cuda)
    elif early.mock_data and early.tokenizer_type is None and not early.help:
        vocab = early.zaya_vocab_size or preset(name)["vocab_size"]
        flags += ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(int(vocab) - 1)]  # + the EOD token
    tp = early.tensor_model_parallel_size
    if tp > 1 and not early.sequence_parallel:
        # Megatron's MoE layer trains under tensor parallelism only with sequence parallelism (moe_layer.py:629)
        flags += ["--sequence-parallel"]
        if is_rank_0():
            print(f"[zaya] --tensor-model-parallel-size {tp} with ZAYA1's experts needs sequence parallelism: added "
                  "--sequence-parallel", flush=True)
    save = EMBEDDED_RUN_DIR if main_job and early.save is None else early.save  # `--save ""`: no checkpoints
    flags += memory_tier_flags(early.zaya_memory_ckpt_interval, early.zaya_memory_ckpt_dir, save)
    if save and early.load is None and not early.zaya_overwrite_save:
        # A run resumes where it saves (Megatron starts afresh from a directory without a checkpoint).
        flags += ["--load", save]
    if reliability.saves_on_sigterm(save, early.zaya_sigterm_deadline):
        flags += ["--exit-signal-handler"]  # Megatron's save-on-SIGTERM; the deadline bounds it
    return flags + argv


def _memory_plan_world_size(early) -> int | None:
    """``--zaya-memory-plan [N]``: N, else the launcher's world size, else 1; None without the flag."""
    if early.zaya_memory_plan is None:
        return None
    if early.zaya_memory_plan == -1:  # the flag without a value
        return int(os.environ.get("WORLD_SIZE", "1"))
    if early.zaya_memory_plan < 1:
        raise UsageError(f"--zaya-memory-plan {early.zaya_memory_plan}: give a number of GPUs >= 1, or nothing")
    return early.zaya_memory_plan


# The flags that name data or its tokenizer.
DATA_FLAGS = ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path", "--data-args-path",
              "--per-split-data-args-path", "--tokenizer-type", "--tokenizer-model")


def _planned_argv(argv: list[str]) -> list[str]:
    """The command a memory plan builds: its data and tokenizer files may exist only on the cluster, and the plan
    needs neither (the vocabulary is the model's, --zaya-vocab-size or the preset's), so --mock-data stands in."""
    takes_one_value = {flag: action.nargs is None for action in zaya_pretrain_parser()._actions
                       for flag in action.option_strings if flag in DATA_FLAGS}  # else every value up to a flag
    kept, skip_values = [], 0
    for token in argv:
        flag = token.split("=", 1)[0]
        if flag in takes_one_value:
            skip_values = 0 if "=" in token else (1 if takes_one_value[flag] else -1)
        elif skip_values and not token.startswith("--"):
            skip_values -= 1
        else:
            skip_values = 0
            kept.append(token)
    return argv if len(kept) == len(argv) else kept + ["--mock-data"]  # no data flag: the main job's corpus


def _parse(argv: list[str], main_job: bool, planning: bool):
    """Megatron's argument parsing with ZAYA1's flags; our checks first, so that bad input fails in one line.
    ``planning``: a memory plan, for a cluster; what this machine lacks is not refused."""
    sys.argv = ["zaya-pretrain", *argv]
    flags = parse_args(add_zaya_args)
    check_args(flags, int(os.environ.get("WORLD_SIZE", "1")), machine_checks=not planning)
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
        raise UsageError(f"--tokenizer-model {flags.tokenizer_model} does not load ({reason}); give the tokenizer's "
                         "directory, or a Hugging Face name that is downloaded or reachable") from error
    tokenizer_vocab = get_tokenizer().vocab_size
    model_vocab = args.zaya_vocab_size or args.padded_vocab_size
    if tokenizer_vocab > model_vocab:
        raise UsageError(f"the tokenizer has {tokenizer_vocab} tokens but the model's vocabulary is {model_vocab}; "
                         "use a tokenizer that fits or raise --zaya-vocab-size")
    args.padded_vocab_size = model_vocab
    zaya_config_from_args(args)  # the model config's own checks, before anything is written
    if args.optimizer == OPTIMIZER_NAME:  # and the optimizer's, which Megatron reaches only when it builds it
        try:
            muon_config_from_args(args)
        except ValueError as error:
            raise UsageError(str(error)) from error
    if args.zaya_memory_ckpt_interval and not planning:
        cfg, par, run = memory_plan_inputs(args)
        check_host_memory(args, memory_tier_host_bytes(memory_plan(cfg, par, run), run, args.world_size))
    if main_job:  # the embedded corpus is tokenised once the flags are known to be sound
        from ..data.preprocess import embedded_dataset_prefix

        embedded_dataset_prefix(EMBEDDED_DATA_DIR)
        check_data(args)
    return args


# A setting Megatron requires (``assert args.<name> is not None``) and the flag that gives it, where the two names
# differ: Megatron copies --seq-length into encoder_seq_length before it checks.
_REQUIRED = re.compile(r"assert args\.(\w+) is not None")
_FLAG_OF = {"encoder_seq_length": "--seq-length"}


def _failed_check(error: AssertionError) -> str:
    """Megatron's bare ``assert``s carry no message: name the flag a missing setting needs, else the check."""
    line = traceback.extract_tb(error.__traceback__)[-1].line
    required = _REQUIRED.fullmatch(line.strip())
    if required:
        name = required.group(1)
        flag = _FLAG_OF.get(name, "--" + name.replace("_", "-"))
        return f"{flag} is missing; give it (Megatron's check `{line}` failed)"
    return f"Megatron's check `{line}` failed"


def run(argv: list[str]) -> None:
    """Run one zaya-pretrain command line: train, or print its memory plan."""
    end_helpers_with_this_process()  # no helper outlives a killed trainer
    end_data_workers_at_exit()  # nor waits forever on data-loader workers at exit
    cuda = torch.cuda.is_available()
    early = early_flags(argv)
    plan_size = _memory_plan_world_size(early)
    if plan_size is not None:  # the plan is for GPUs and for the world size asked, whatever this machine is
        cuda = True
        os.environ["WORLD_SIZE"] = str(plan_size)
        argv = _planned_argv(argv)
    argv, relaunched = resume.overwrite_on_first_launch_only(argv, relaunch_count())
    if relaunched and is_rank_0():
        print(relaunched, flush=True)
    main_job = runs_main_job(early_flags(argv))
    user_argv, argv = argv, build_argv(argv, cuda)  # as given: the command that resumes is printed from it
    try:  # unknown names, the cpu group left out on a CPU, a kernel patch asked for that cannot apply here
        check_patch_selection(early.zaya_patches, needs_cpu_group=not cuda)
        patches = apply_patches(early.zaya_patches, log=START_LOG.append)
    except PatchError as error:
        raise UsageError(str(error)) from error
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # a single process without a launcher
        os.environ["MASTER_PORT"] = str(free_master_port(os.environ["MASTER_ADDR"]))
    # Megatron requires it with TP or CP (one hardware queue keeps communication kernels in launch order), as its
    # example scripts export; set before the first CUDA context.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

    args = _parse(argv, main_job, planning=plan_size is not None)
    if args.zaya_watchdog_seconds:  # what a hang's dump reads; before Megatron creates the process groups
        record_collectives()
    if args.pipeline_model_parallel_size > 1 and patches.get("pipeline.stage_tensor_width") not in APPLIED:
        raise UsageError("pipeline parallelism needs the pipeline.stage_tensor_width patch (stages exchange hidden + "
                         "router-state channels); add it to --zaya-patches")
    recipe_flags = args.zaya_router_freeze_tokens or args.zaya_expert_clip_grad
    if recipe_flags and patches.get("optim.zaya_muon") not in APPLIED:
        raise UsageError("--zaya-router-freeze-tokens and --zaya-expert-clip-grad act through the optim.zaya_muon "
                         "patch; add it to --zaya-patches")
    if plan_size is not None:
        print(memory_plan_report(*memory_plan_inputs(args)), flush=True)
        return
    resuming = resume.check_save_and_load(args, user_argv)
    if args.save:
        check_save_dir(args.save)
        save_lock.lock_save_dir(args.save, args.zaya_save_lock_stale_after)
        if is_rank_0():  # one rank deletes, and says what happens
            line = resume.remove_checkpoints(args.save) if args.zaya_overwrite_save else resuming
            if line:
                print(line, flush=True)
            if args.zaya_overwrite_save:  # a fresh run: the failures of the old one are not its own
                (Path(args.save) / LEDGER_FILE).unlink(missing_ok=True)
        if args.zaya_overwrite_save and args.non_persistent_ckpt_type == "local" and \
                os.environ.get("LOCAL_RANK", "0") == "0":  # one rank per node: the local tier is per node
            local_tier.remove_parts(args.non_persistent_local_ckpt_dir)
    LEDGER.open(args.save)
    if not args.zaya_no_self_test:
        health.check_this_node()
    if not args.zaya_overwrite_save:
        _guard_against_crash_loops(args)
    write_start_log(args.save, sum(state == "applied" for state in patches.values()), len(patches))
    if reliability.saves_on_sigterm(args.save, args.zaya_sigterm_deadline):
        reliability.arm_sigterm_deadline(args.zaya_sigterm_deadline, args.save)
    plot = args.zaya_loss_plot or (str(Path(args.save) / "loss.png") if args.save else None)
    LOSS_CURVE.path = Path(plot) if plot else None
    try:
        megatron.training.pretrain(pretrain_cfg_container_from_args(args, None), train_valid_test_datasets_provider,
                                   ModelType.encoder_or_decoder, reliability.GUARD.watch(forward_step),
                                   model_provider=model_provider)
    except SystemExit as stop:  # --exit-interval, --exit-duration-in-mins, SIGTERM: the curve so far is kept too
        if stop.code in (None, 0):
            _finish(args, user_argv, plot, stopped_early=True)
            _record_end(args, "stopped early (--exit-interval, --exit-duration-in-mins or a saved pre-emption)")
        else:
            _record_crash(args, f"exit {stop.code}")
        raise
    except UsageError:  # bad input found on the way (no intact checkpoint, one that does not fit): no fault
        raise
    except BaseException as error:
        _record_crash(args, last_error_line(error))
        raise
    _finish(args, user_argv, plot)
    _record_end(args, "finished")


def _step(args) -> int | None:
    """The step in progress (1-based), None before the first."""
    return args.curr_iteration + 1 if hasattr(args, "curr_iteration") else None


def _record_crash(args, cause: str) -> None:
    LEDGER.failure("crash", _step(args), cause, read_tracker(args.save) if args.save else None)


def _record_end(args, cause: str) -> None:
    if is_rank_0():
        LEDGER.record("end", _step(args), cause)


def _guard_against_crash_loops(args) -> None:
    """Before training, on every rank: a step that failed in ``--zaya-max-step-failures`` launches in a row stops
    the run (:class:`CrashLoop`), or with ``--zaya-skip-failing-steps`` joins ``--iterations-to-skip`` (Megatron
    then consumes its batch without training on it), as do the steps skipped by earlier launches."""
    events = LEDGER.events()
    failing = failing_step(events, args.zaya_max_step_failures)
    if failing and not args.zaya_skip_failing_steps:
        raise CrashLoop(f"step {failing['step']} failed in {args.zaya_max_step_failures} launches in a row "
                        f"(--zaya-max-step-failures {args.zaya_max_step_failures}), last on rank {failing['rank']} "
                        f"({failing['node']}): {failing['cause']}; stopping instead of restarting (exit "
                        f"{CRASH_LOOP_EXIT_CODE}). Fix the cause and relaunch with a higher --zaya-max-step-failures, "
                        f"or skip the step's batch with --zaya-skip-failing-steps ({LEDGER.path})")
    if failing and is_rank_0():
        LEDGER.record("skipped_step", failing["step"], f"failed in {args.zaya_max_step_failures} launches in a "
                      f"row, last: {failing['cause']}; its batch is skipped (--zaya-skip-failing-steps)", steps_lost=1)
    skipped = {e["step"] for e in events if e["event"] == "skipped_step"} | ({failing["step"]} if failing else set())
    args.iterations_to_skip = sorted(set(args.iterations_to_skip or []) | skipped)


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
    if plot:  # every rank: each holds the losses of its share of the batch
        LOSS_CURVE.pool(curve_group())
    if not writes_curve():
        return
    lines = []
    if plot and LOSS_CURVE.points():
        lines.append(f"loss curve: {LOSS_CURVE.write()}")
    if stopped_early:
        then = (f"the last checkpoint: {describe_latest_checkpoint(args.save)}; resume with: "
                f"{resume.resume_command(user_argv, args.save)}" if args.save else "nothing saved (no --save)")
        print(f"[zaya] stopped early; {'; '.join(lines) or 'no loss curve'}; {then}", flush=True)
        return
    if args.save:
        lines += [f"checkpoint: {args.save}", f"continue training: {shlex.join(continue_command(args, user_argv))}",
                  f"convert to Hugging Face: {shlex.join(export_command(args))}"]
    if lines:
        print("\n[zaya] done.\n  " + "\n  ".join(lines), flush=True)
