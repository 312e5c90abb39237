"""``zaya-pretrain`` arguments: Megatron's own flags, ZAYA1's ``--zaya-*`` flags, and presets as flag bundles.

A preset expands to ordinary Megatron flags placed *before* the user's, so an explicit flag always wins
(argparse keeps the last value). ZAYA1's fixed choices (RMSNorm, SwiGLU, no biases, RoPE, top-1 routing,
no aux loss, no dropout) are such a bundle too, made from ZayaConfig's ``megatron_field`` declarations.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import os
import re
from pathlib import Path
from typing import NamedTuple

import torch

from ..config import ATTENTION_TYPES, PRESETS, ZayaConfig, kernel_selection, preset
from ..dataclass_flags import add_flags, fixed_megatron_values, flagged_fields, megatron_flags, values_from_args
from ..errors import UsageError, ZayaConfigError
from ..memory_plan import Parallel, Run
from ..optim import add_muon_args
from .data_checks import DEFAULT_SPLIT, indexed_dataset_problem, split_problem


# ZAYA1's architecture and run defaults, expressed in Megatron's flags.
ZAYA_FLAGS = megatron_flags(ZayaConfig) + [
    "--position-embedding-type", "rope", "--transformer-impl", "local", "--ckpt-format", "torch_dist",
    "--eval-interval", "1000",  # Megatron leaves it unset and then fails on the first step; any flag overrides it
]

# Megatron's flags whose name is not the ZayaConfig field's (``--num-layers`` sets ``num_layers`` and so on).
_MEGATRON_FLAGS = {"num_moe_experts": "--num-experts",
                   "tie_embeddings": "--untie-embeddings-and-output-weights", "layernorm_epsilon": "--norm-epsilon"}


def field_flag(field: str) -> str:
    """The flag that sets a ZayaConfig field: its ``setting`` flag, else Megatron's."""
    declared = {f.name: f.metadata["flag"] for f in flagged_fields(ZayaConfig)}
    return declared.get(field) or _MEGATRON_FLAGS.get(field, "--" + field.replace("_", "-"))


def preset_flags(name: str) -> list[str]:
    """The Megatron / ZAYA flags a preset stands for."""
    return shape_flags(preset(name))


def shape_flags(values: dict) -> list[str]:
    """The Megatron / ZAYA flags that set these ZayaConfig fields (a preset's, or a model's)."""
    flags = ["--group-query-attention"]
    for field, value in values.items():
        text = str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
        flags += [field_flag(field), text]  # Megatron parses --rotary-base as an int
    flags += ["--moe-ffn-hidden-size", str(values["ffn_hidden_size"])]
    return flags


def add_zaya_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: the ``--zaya-*`` flags, and a parser whose errors are two lines.

    argparse prints its usage line before an error; generated from Megatron's ~700 flags it is hundreds of
    lines, so it is replaced by a short one. A bare ``%`` in a Megatron help string (e.g. "90% of data")
    breaks argparse's ``%``-formatting of ``--help``; it is escaped."""
    parser.usage = "%(prog)s [--zaya-preset NAME] [Megatron and --zaya-* flags]  (--help lists them)"
    for action in parser._actions:
        if action.help:
            action.help = re.sub(r"%%|%\(|%", lambda m: "%%" if m.group() == "%" else m.group(), action.help)
    g = parser.add_argument_group("ZAYA1")
    g.add_argument("--zaya-preset", choices=sorted(PRESETS), default=None,
                   help="fill the model flags with a named shape; explicit flags win")
    g.add_argument("--zaya-patches", default=None,
                   help="patch hooks to apply: all | none | ids/groups, comma-separated (zaya-patches list)")
    add_flags(g, ZayaConfig, "zaya_")
    g.add_argument("--zaya-loss-plot", default=None, help="write the training-loss curve here (PNG)")
    # The training recipe (docs/training.md, "From 4k to 128k").
    g.add_argument("--zaya-router-freeze-tokens", type=int, default=0, metavar="N",
                   help="the routers' parameters (down-projection, depth-averaging scale, MLP) take no updates for the "
                        "first N training tokens, then train; the balancing biases keep updating; 0: off")
    g.add_argument("--zaya-expert-clip-grad", type=float, default=0.0, metavar="C",
                   help="clip the expert weights' global gradient norm to C before --clip-grad clips all gradients; "
                        "0: off")
    g.add_argument("--zaya-expert-load-warn-ratio", type=float, default=0.0, metavar="R",
                   help="warn once when a layer's busiest expert takes more than R times an even share (1/E) for "
                        "--zaya-expert-load-warn-intervals log intervals in a row; 0: off")
    g.add_argument("--zaya-expert-load-warn-intervals", type=int, default=3, metavar="K",
                   help="log intervals in a row over --zaya-expert-load-warn-ratio before the warning")
    g.add_argument("--zaya-memory-plan", type=int, nargs="?", const=-1, default=None, metavar="WORLD_SIZE",
                   help="print the per-GPU memory plan of this command for WORLD_SIZE GPUs (default: the launcher's "
                        "world size, else 1) and exit, without building the model")
    # Fault handling (docs/reliability.md).
    g.add_argument("--zaya-max-nonfinite-steps", type=int, default=5,
                   help="stop after this many steps in a row with a non-finite loss or gradient (each one is "
                        "skipped); 0: never stop")
    g.add_argument("--zaya-loss-spike-sigma", type=float, default=6.0,
                   help="log a loss this many standard deviations above the recent window; 0: off")
    g.add_argument("--zaya-loss-spike-window", type=int, default=100, help="steps in the loss-spike window")
    g.add_argument("--zaya-replica-check-interval", type=int, default=100,
                   help="compare the weights of data-parallel replicas every this many steps; 0: off")
    g.add_argument("--zaya-sigterm-deadline", type=float, default=20.0,
                   help="with --save, SIGTERM (pre-emption, scancel) saves at the end of the current step and exits "
                        "0 within this many seconds, else exits 3 without the save; 0: no save on SIGTERM")
    g.add_argument("--zaya-watchdog-seconds", type=float, default=0.0,
                   help="a rank that makes no progress for this long (10x before its first step, at least 4x its "
                        "slowest step, never during a save) dumps every thread's stack and exits 4, for torchrun "
                        "--max-restarts to restart from the newest checkpoint; 0: off")
    g.add_argument("--zaya-gc-interval", type=int, default=100,
                   help="Python's garbage collector runs between steps, every this many steps (Megatron's --manual-gc "
                        "--manual-gc-interval), over what the steps created: set-up's objects are frozen; 0: "
                        "Python's automatic collector, which may pause any step")
    g.add_argument("--zaya-max-step-failures", type=int, default=3,
                   help="stop, at the next launch, a run whose same step failed (a crash or a hang) in this many "
                        "launches in a row, as recorded in <save>/events.jsonl (exit 5); 0: never stop")
    g.add_argument("--zaya-skip-failing-steps", action="store_true",
                   help="instead of stopping, skip the batch of a step that failed --zaya-max-step-failures times "
                        "(recorded in <save>/events.jsonl)")
    g.add_argument("--zaya-no-self-test", action="store_true",
                   help="skip the node self-test before training (a GEMM, a memory write and read, ECC counters)")
    g.add_argument("--zaya-allow-tokenizer-change", action="store_true",
                   help="load a checkpoint trained with another tokenizer (each token id keeps its embedding)")
    g.add_argument("--zaya-allow-rotary-base-change", action="store_true",
                   help="load a checkpoint trained with another RoPE base (--rotary-base, --zaya-sliding-rotary-base): "
                        "the next stage of a run that extends its context")
    g.add_argument("--zaya-overwrite-save", action="store_true",
                   help="start afresh into a --save directory that holds a checkpoint, deleting it (without this "
                        "flag a run resumes from its --save, and refuses to start afresh into it)")
    g.add_argument("--zaya-save-lock-stale-after", type=float, default=300.0,
                   help="take over the lock of a --save directory whose heartbeat (refreshed every tenth of this) is "
                        "older than this many seconds, or whose run on this host has ended")
    g.add_argument("--zaya-local-ckpt-keep", type=int, default=2,
                   help="with --non-persistent-ckpt-type local: each rank keeps its newest this many local checkpoints")
    g.add_argument("--zaya-memory-ckpt-interval", type=int, default=None, metavar="N",
                   help="every N steps, save the full training state into host memory that outlives the training "
                        "processes (shared memory, --zaya-memory-ckpt-dir), each rank's part also copied to a rank "
                        "on another node; a resume takes the newest intact state of any tier (needs --save)")
    g.add_argument("--zaya-memory-ckpt-keep", type=int, default=2,
                   help="with --zaya-memory-ckpt-interval: each rank keeps its newest this many in-memory checkpoints")
    g.add_argument("--zaya-memory-ckpt-dir", default=None,
                   help="with --zaya-memory-ckpt-interval: the in-memory tier's directory on each node (default: "
                        "/dev/shm/zaya-<name of --save>-<hash of its path>, one per run)")
    return add_muon_args(parser)  # --zaya-muon-* and the --optimizer zaya_muon choice


@functools.cache
def zaya_pretrain_parser() -> argparse.ArgumentParser:
    """zaya-pretrain's parser: Megatron's with the ZAYA1 flags, as Megatron's ``parse_args(add_zaya_args)`` builds
    it (the patches that add choices to Megatron's flags aside)."""
    from megatron.training.arguments import add_megatron_arguments

    return add_zaya_args(add_megatron_arguments(argparse.ArgumentParser(prog="zaya-pretrain", allow_abbrev=False)))


# The flags zaya-pretrain reads before Megatron parses the command line: they choose the flags it gives Megatron
# (preset, main job, implied --load, save on SIGTERM, garbage collection, the in-memory tier), the patches, and the
# memory plan.
EARLY_FLAGS = frozenset({
    "--zaya-preset", "--zaya-patches", "--zaya-memory-plan", "--zaya-vocab-size", "--zaya-sigterm-deadline",
    "--zaya-overwrite-save", "--vocab-size", "--tokenizer-type", "--data-path", "--train-data-path",
    "--data-args-path", "--mock-data", "--train-iters", "--save", "--load", "--tensor-model-parallel-size",
    "--sequence-parallel", "--async-save", "--zaya-gc-interval", "--zaya-memory-ckpt-interval",
    "--zaya-memory-ckpt-dir"})


def early_flags(argv: list[str]) -> argparse.Namespace:
    """The ``EARLY_FLAGS`` of a command line, and ``help``, parsed as zaya-pretrain's parser declares them (type,
    number of values, default), the other flags left for later. Choices are left to the full parse and to our
    checks, which name the fix."""
    full = zaya_pretrain_parser()
    early = argparse.ArgumentParser(prog=full.prog, usage=full.usage, add_help=False, allow_abbrev=False)
    early.add_argument("-h", "--help", action="store_true")
    for action in full._actions:
        if EARLY_FLAGS.intersection(action.option_strings):
            declared = copy.copy(action)
            declared.choices = None
            early._add_action(declared)
    return early.parse_known_args(argv)[0]


def expand_attention_types(spec: str | None, num_layers: int) -> list[str] | None:
    if spec is None:
        return None
    pattern = [t.strip() for t in spec.split(",") if t.strip()]
    unknown = set(pattern) - set(ATTENTION_TYPES)
    if unknown or not pattern:
        raise UsageError(f"--zaya-attention-types: unknown types {sorted(unknown)}; use {','.join(ATTENTION_TYPES)}")
    return [pattern[i % len(pattern)] for i in range(num_layers)]


def weight_gradient_fusion_available() -> bool:
    """Whether Megatron's linear layers can accumulate weight gradients into ``main_grad``: apex's
    ``fused_weight_gradient_mlp_cuda``, or the ``kernels.weight_gradient_accumulation`` patch's stand-in (GPUs)."""
    from megatron.core.tensor_parallel import layers

    return layers._grad_accum_fusion_available


def zaya_config_from_args(args) -> ZayaConfig:
    """The model config of a (validated) Megatron args namespace."""
    from megatron.training.argument_utils import core_transformer_config_from_args

    overrides = dict(  # over what Megatron parsed: ZAYA1's fixed values that no flag sets, then the --zaya-* flags
        fixed_megatron_values(ZayaConfig) | values_from_args(ZayaConfig, args, "zaya_"),
        vocab_size=args.padded_vocab_size, max_position_embeddings=args.max_position_embeddings,
        tie_embeddings=not args.untie_embeddings_and_output_weights, rotary_percent=args.rotary_percent,
        rotary_base=float(args.rotary_base),
        attention_types=expand_attention_types(args.zaya_attention_types, args.num_layers),
        gradient_accumulation_fusion=args.gradient_accumulation_fusion and weight_gradient_fusion_available(),
        pipeline_dtype=torch.float32,  # pipeline stages exchange the fp32 residual stream and router state
    )
    view = argparse.Namespace(**{**vars(args), **overrides})  # Megatron copies same-named fields from args
    try:
        return core_transformer_config_from_args(view, ZayaConfig)
    except ZayaConfigError as error:
        raise UsageError(str(error)) from error


def memory_plan_inputs(args) -> tuple[ZayaConfig, Parallel, Run]:
    """The memory plan's inputs (``memory_plan.report(*inputs)``) of a parsed ``zaya-pretrain`` command line."""
    cfg = zaya_config_from_args(args)
    par = Parallel(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                   ep=args.expert_model_parallel_size,
                   etp=args.expert_tensor_parallel_size or args.tensor_model_parallel_size,
                   cp=args.context_parallel_size, dp=args.data_parallel_size)
    model_parallel = par.pp * par.ep * par.etp
    par.expert_dp = max(1, args.world_size // model_parallel)
    # Megatron turns --use-distributed-optimizer into its layer-wise flag for optimizers other than Adam and SGD
    # (arguments.py:1680); zaya_muon shards by data-parallel owner under it (optim/zero.py).
    sharded_optimizer = args.use_distributed_optimizer or getattr(args, "use_layer_wise_distributed_optimizer", False)
    run = Run(micro_batch=args.micro_batch_size, seq=args.seq_length, global_batch=args.global_batch_size,
              optimizer=args.optimizer, bf16=bool(args.bf16), distributed_optimizer=bool(sharded_optimizer),
              grad_bf16=not args.accumulate_allreduce_grads_in_fp32 if args.bf16 else False,
              bf16_momentum=getattr(args, "zaya_muon_momentum_dtype", "fp32") == "bf16",
              recompute=args.recompute_granularity, recompute_method=args.recompute_method or "uniform",
              recompute_num_layers=1 if args.recompute_num_layers is None else args.recompute_num_layers,
              recompute_modules=tuple(cfg.zaya_recompute_modules), cuda_graphs=bool(args.zaya_cuda_graphs),
              sequence_parallel=bool(args.sequence_parallel),
              lm_head_grad_in_forward=cfg.lm_head_grad_in_forward, async_save=bool(args.async_save),
              memory_ckpt_keep=args.zaya_memory_ckpt_keep if args.zaya_memory_ckpt_interval else 0,
              gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", min(args.world_size, 8))))
    return cfg, par, run


# --------------------------------------------------------------------------------- checks before Megatron
def _data_prefixes(values: list[str] | None) -> list[str]:
    """The path prefixes of a ``--data-path`` list (``[w1] p1 [w2] p2 ...``)."""
    if not values:
        return []
    def is_number(text):
        try:
            float(text)
            return True
        except ValueError:
            return False
    return [v for v in values if not is_number(v)]


class Bounds(NamedTuple):
    """The values a numeric flag takes: from ``low`` up to ``high`` (below it where ``below``; None: unbounded);
    ``zero``: what 0 turns off, where ``low`` is 0."""

    low: float
    high: float | None = None
    below: bool = False
    zero: str = ""

    def problem(self, flag: str, value) -> str | None:
        """The one-line error for ``value`` of ``flag`` (None when it is not given), or None when it is allowed."""
        if value is None or (value >= self.low and (self.high is None or value < self.high
                                                    or value == self.high and not self.below)):
            return None
        if self.high is not None:
            return f"{flag} {value:g}: must be at least {self.low:g} and {'below' if self.below else 'at most'} " \
                   f"{self.high:g}"
        if self.low == 0:
            return f"{flag} {value:g} is negative; give 0 or more" + (f" (0: {self.zero})" if self.zero else "")
        return f"{flag} {value}: must be at least {self.low:g}"


_COUNT, _NON_NEGATIVE, _FRACTION, _BETA = Bounds(1), Bounds(0), Bounds(0, 1), Bounds(0, 1, below=True)

# Numeric flags whose range nothing checks before training: Megatron's, and --zaya-vocab-size, whose 0 the command
# takes as "not given" before ZayaConfig sees it. Out of range, a run fails with a traceback (at start-up, or steps
# later) or trains on as if the flag were not given.
FLAG_BOUNDS = {
    "--micro-batch-size": _COUNT, "--global-batch-size": _COUNT, "--train-iters": _COUNT, "--train-samples": _COUNT,
    "--seq-length": _COUNT, "--max-position-embeddings": _COUNT, "--dist-ckpt-workers": _COUNT,
    "--num-layers": _COUNT, "--hidden-size": _COUNT, "--ffn-hidden-size": _COUNT, "--moe-ffn-hidden-size": _COUNT,
    "--num-attention-heads": _COUNT, "--num-query-groups": _COUNT, "--kv-channels": _COUNT, "--num-experts": _COUNT,
    "--zaya-vocab-size": _COUNT, "--rotary-base": _COUNT, "--seed": _COUNT,
    "--log-interval": _COUNT, "--eval-interval": _COUNT, "--lr-decay-iters": _COUNT,
    "--tensor-model-parallel-size": _COUNT, "--pipeline-model-parallel-size": _COUNT,
    "--context-parallel-size": _COUNT, "--expert-model-parallel-size": _COUNT,
    "--expert-tensor-parallel-size": _COUNT,
    "--lr": _NON_NEGATIVE, "--min-lr": _NON_NEGATIVE, "--weight-decay": _NON_NEGATIVE,
    "--init-method-std": _NON_NEGATIVE, "--adam-eps": _NON_NEGATIVE,
    "--lr-warmup-iters": Bounds(0, zero="no warm-up"), "--eval-iters": Bounds(0, zero="no evaluation"),
    "--clip-grad": Bounds(0, zero="no clipping"),
    "--hidden-dropout": _FRACTION, "--attention-dropout": _FRACTION, "--lr-warmup-fraction": _FRACTION,
    "--adam-beta1": _BETA, "--adam-beta2": _BETA,
}  # fmt: skip


def _check_flag_combinations(args) -> None:
    """Values and combinations Megatron asserts on without a message, or accepts silently."""
    if args.mock_data and (args.data_path or args.train_data_path):
        raise UsageError("--mock-data and --data-path both given; drop --mock-data to train on the data")
    if args.zaya_save_lock_stale_after <= 0:
        raise UsageError(f"--zaya-save-lock-stale-after {args.zaya_save_lock_stale_after:g}: give a positive number of "
                         "seconds")
    if args.zaya_sigterm_deadline < 0:
        raise UsageError(f"--zaya-sigterm-deadline {args.zaya_sigterm_deadline:g} is negative; give the seconds a save "
                         "on SIGTERM may take, or 0 to turn it off")
    if args.zaya_watchdog_seconds < 0:
        raise UsageError(f"--zaya-watchdog-seconds {args.zaya_watchdog_seconds:g} is negative; give the seconds "
                         "without progress that make a hang, or 0 to turn the watchdog off")
    if args.zaya_max_step_failures < 0:
        raise UsageError(f"--zaya-max-step-failures {args.zaya_max_step_failures} is negative; give the launches in a "
                         "row a step may fail before the run stops, or 0 to never stop")
    if args.zaya_skip_failing_steps and not (args.save and args.zaya_max_step_failures):
        raise UsageError("--zaya-skip-failing-steps needs --save (its events.jsonl records the failures) and "
                         "--zaya-max-step-failures above 0; add them or drop --zaya-skip-failing-steps")
    if args.data_path and args.tokenizer_type is None:
        raise UsageError("--data-path needs the tokenizer the data was built with: add --tokenizer-type "
                         "HuggingFaceTokenizer --tokenizer-model <the directory or name given to zaya-preprocess>")
    model = args.tokenizer_model
    looks_like_a_path = model and (model.startswith((".", "~", os.sep)) or model.count("/") > 1)  # not org/name
    if looks_like_a_path and not Path(model).expanduser().exists():
        raise UsageError(f"--tokenizer-model {model}: no such directory (relative paths start at {os.getcwd()}); "
                         "give the tokenizer's directory or a Hugging Face name")
    if args.bf16 and args.fp16:
        raise UsageError("--bf16 and --fp16 both given; choose one")
    for flag, bounds in FLAG_BOUNDS.items():
        problem = bounds.problem(flag, getattr(args, flag[2:].replace("-", "_")))
        if problem:
            raise UsageError(problem)
    if args.zaya_balancing_warmup_steps < 0:  # as ZayaConfig.validate_zaya, before Megatron's own checks
        raise UsageError(f"--zaya-balancing-warmup-steps {args.zaya_balancing_warmup_steps} is negative; give a "
                         "number of steps >= 0 (0: no warm-up)")
    for flag, value in (("--zaya-router-freeze-tokens", args.zaya_router_freeze_tokens),
                        ("--zaya-expert-clip-grad", args.zaya_expert_clip_grad),
                        ("--zaya-expert-load-warn-ratio", args.zaya_expert_load_warn_ratio)):
        if value < 0:
            raise UsageError(f"{flag} {value:g} is negative; give a positive value, or 0 to turn it off")
    if args.zaya_expert_load_warn_intervals < 1:
        raise UsageError(f"--zaya-expert-load-warn-intervals {args.zaya_expert_load_warn_intervals}: give a number of "
                         "log intervals >= 1")
    if args.zaya_balance_skip_class and not args.zaya_skip_class:
        raise UsageError("--zaya-balance-skip-class with --zaya-no-skip-class: there is no skip class to balance; "
                         "drop one of them")


def check_data(args) -> None:
    """Fail in one line on damaged, missing or too small datasets (after the flags: the embedded corpus is built
    only for a command whose flags are sound)."""
    for prefix in _data_prefixes(args.data_path) + _data_prefixes(args.train_data_path):
        for suffix in (".bin", ".idx"):
            path = Path(prefix + suffix)
            if not path.is_file() or not os.access(path, os.R_OK):
                raise UsageError(f"data path {prefix!r}: {path} is missing or unreadable; build it with "
                                 "zaya-preprocess or fix --data-path")
        problem = indexed_dataset_problem(prefix, args.seq_length)
        if problem:
            raise UsageError(problem)
    for prefix in _data_prefixes(args.data_path):
        problem = split_problem(prefix, args.split or DEFAULT_SPLIT, args.seq_length)
        if problem:
            raise UsageError(problem)


def check_args(args, world_size: int, machine_checks: bool = True) -> None:
    """Fail early, in one line, on flags Megatron would reject with a traceback (or not at all).

    ``machine_checks=False`` (``--zaya-memory-plan``, which plans for a cluster): what this machine lacks (a GPU,
    Transformer Engine) is not refused."""
    from ..checkpoint.tiers import check_args as check_checkpoint_tiers

    _check_flag_combinations(args)
    check_checkpoint_tiers(args)
    try:
        kernel_selection(args.zaya_kernels)
    except ZayaConfigError as error:
        raise UsageError(f"--zaya-kernels: {error}") from error
    if args.max_position_embeddings is not None and args.seq_length is not None \
            and args.seq_length > args.max_position_embeddings:
        raise UsageError(f"--seq-length {args.seq_length} exceeds the model's positions "
                         f"(--max-position-embeddings {args.max_position_embeddings}); shorten it or raise the limit")
    if args.lr is not None and args.min_lr > args.lr:
        raise UsageError(f"--min-lr {args.min_lr} is above --lr {args.lr}; lower --min-lr (the main job's is 3e-4)")
    decay_iters = args.lr_decay_iters or args.train_iters
    if decay_iters is not None and args.lr_warmup_iters and args.lr_warmup_iters >= decay_iters:
        raise UsageError(f"--lr-warmup-iters {args.lr_warmup_iters} must be below the decay length {decay_iters} "
                         "(--lr-decay-iters, else --train-iters); shorten the warmup")
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    ep = args.expert_model_parallel_size
    etp = args.expert_tensor_parallel_size or tp
    if cp > 1 and args.seq_length is not None:
        # Megatron's load-balanced split cuts each sequence into 2*CP equal chunks, each at least as long as the
        # halo of the CCA convolutions (which reaches into the preceding chunk only).
        halo = (args.zaya_cca_time0 - 1) + (args.zaya_cca_time1 - 1)
        if args.seq_length % (2 * cp):
            raise UsageError(f"--seq-length {args.seq_length} is not divisible by 2*CP = {2 * cp} (context "
                             "parallelism splits sequences into 2*CP chunks); change the sequence length or CP size")
        if args.seq_length // (2 * cp) < halo:
            raise UsageError(f"--seq-length {args.seq_length} gives chunks of {args.seq_length // (2 * cp)} tokens, "
                             f"shorter than the CCA convolution halo ({halo}); use a longer sequence or smaller CP")
    placement = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                 "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
                 "account_for_loss_in_pipeline_split")
    custom_placement = any(getattr(args, name, None) not in (None, False) for name in placement)
    if pp > 1 and args.num_layers and args.num_layers % pp and not custom_placement:
        raise UsageError(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}; "
                         "change one of them (or place layers with --decoder-first/last-pipeline-num-layers)")
    if world_size % (tp * pp * cp):
        raise UsageError(f"world size {world_size} is not divisible by TP*PP*CP = {tp}*{pp}*{cp}; "
                         "change the parallel sizes or the number of processes")
    if world_size % (etp * ep * pp):
        raise UsageError(f"world size {world_size} is not divisible by expert TP*EP*PP = {etp}*{ep}*{pp}; "
                         "change --expert-model-parallel-size")
    if args.num_experts and args.num_experts % ep:
        raise UsageError(f"--num-experts {args.num_experts} is not divisible by --expert-model-parallel-size {ep}")
    if machine_checks and args.train_iters is None and args.train_samples is None:  # a memory plan needs none
        raise UsageError("the run has no length: give --train-iters N (or --train-samples N)")
    if args.train_iters is not None and args.train_samples is not None:
        raise UsageError(f"--train-iters {args.train_iters} and --train-samples {args.train_samples} both give the "
                         "run's length; keep one")
    batch, micro, dp = args.global_batch_size, args.micro_batch_size, world_size // (tp * pp * cp)
    if batch and micro and batch % (micro * dp):
        raise UsageError(f"--global-batch-size {batch} is not a multiple of --micro-batch-size {micro} x the "
                         f"data-parallel size {dp}; give a multiple of {micro * dp}, e.g. "
                         f"{-(-batch // (micro * dp)) * micro * dp}")
    if args.num_query_groups and args.num_query_groups % tp:
        raise UsageError(f"--num-query-groups {args.num_query_groups} is not divisible by TP {tp}: CCA splits "
                         "KV heads across TP ranks; use a TP size that divides the KV heads")
    if args.zaya_cuda_graphs and args.overlap_param_gather:
        raise UsageError("--zaya-cuda-graphs with --overlap-param-gather: the graphed layers would skip its wait for "
                         "the parameters' all-gather; drop one of them")
    if args.reset_position_ids != args.reset_attention_mask:
        raise UsageError("packed documents take --reset-position-ids and --reset-attention-mask together (ZAYA1 finds "
                         "document starts from the reset position ids); give both or neither")
    # Megatron derives its virtual pipeline size later, from either flag (a size of 1 is none).
    virtual = (args.num_layers_per_virtual_pipeline_stage is not None
               or (args.num_virtual_stages_per_pipeline_rank or 1) > 1)
    if args.reset_position_ids and (pp > 2 or virtual):
        raise UsageError("--reset-position-ids with more than two pipeline stages (or virtual stages): only the "
                         "first and last stage read the batch's position ids; use at most 2 stages, no virtual ones")
    if getattr(args, "cuda_graph_impl", "none") != "none":
        raise UsageError(f"--cuda-graph-impl {args.cuda_graph_impl}: Megatron's graphs do not capture ZAYA1 layers; "
                         "use --zaya-cuda-graphs")
    if machine_checks and args.zaya_cuda_graphs and not torch.cuda.is_available():
        raise UsageError("--zaya-cuda-graphs needs a GPU (none is visible here); drop it on CPU")
    if machine_checks and args.zaya_core_attention == "te" and importlib.util.find_spec("transformer_engine") is None:
        raise UsageError("--zaya-core-attention te needs Transformer Engine, which is not installed here; install "
                         "it or use --zaya-core-attention sdpa (the default)")
