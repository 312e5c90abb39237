"""Patch group ``megatron_fixes``: bugs of megatron-core 0.19.2 that hit every platform.

``optimizer_split_changed``: a clear error instead of a deep one when a checkpoint's optimizer state was
saved with another split into dense and expert optimizers (EP or ETP changed).

``distopt.*``: ``--use-distributed-optimizer`` without Transformer Engine or apex. Megatron's
``DistributedOptimizer`` then wraps plain ``torch.optim.Adam``/``AdamW`` (distrib_optimizer.py:20-35), whose
per-parameter ``step`` tensor the fused optimizers do not have. Its checkpoint code for that case has three
faults which together make ``--load`` fail, and once the failures are worked around, resume *silently wrong*:

1. ``state_dict()`` asserts that the Adam state holds exactly one ``step`` value, so it fails on the fresh
   optimizer that ``--load`` builds (``megatron_fixes.distopt_fresh_state``);
2. ``load_state_dict()`` gives every parameter the *same* ``step`` tensor, which torch's Adam then
   increments once per parameter per iteration: after a resume the bias corrections run ahead and the
   updates change from the second resumed iteration on (``megatron_fixes.distopt_step_per_param``);
3. loading the parameter state copies the fresh optimizer's ``step`` over the checkpoint's (the default
   ``dp_reshardable`` format: silently wrong) or fails on the missing ``step`` (the other formats), and an
   fp32 run's copies into views of the model's parameters with autograd on, which torch refuses
   (``megatron_fixes.distopt_load_moments_only``).

All three apply when megatron-core is 0.19.x and neither Transformer Engine nor apex provides FusedAdam
(a GPU machine without them included). Off: leave them out of ``--zaya-patches`` / ``ZAYA_PATCHES``; then
``--use-distributed-optimizer`` cannot resume from a checkpoint without TE or apex.
"""

from __future__ import annotations

import functools
import inspect

import torch

from .registry import fused_adam_present, register, replace_attr

DISTOPT = "megatron.core.optimizer.distrib_optimizer"


def _distopt_fix(patch_id: str, method: str):
    """Register a ``distopt`` fix; its docstring gains the line saying how to turn it off."""
    patch_id = f"megatron_fixes.{patch_id}"

    def decorate(fn):
        off = f"Off: leave ``{patch_id}`` out of ``--zaya-patches`` / ``ZAYA_PATCHES``."
        fn.__doc__ = f"{inspect.cleandoc(fn.__doc__)}\n\n{off}"
        return register(patch_id, target=f"{DISTOPT}.DistributedOptimizer.{method}", megatron=">=0.19,<0.20",
                        requires=fused_adam_present)(fn)

    return decorate


def _initialise_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter the state torch's Adam/AdamW create on their first step (step 0, zero moments)."""
    for group in optimizer.param_groups:
        on_device = group.get("capturable", False) or group.get("fused", False)
        for param in group["params"]:
            state = optimizer.state[param]
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device if on_device else "cpu")
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if group.get("amsgrad", False):
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


@_distopt_fix("distopt_fresh_state", "state_dict")
def distopt_fresh_state() -> None:
    """Let ``DistributedOptimizer.state_dict()`` run before the first step: create Adam's initial state.

    Without TE/apex, ``state_dict()`` reads the step from the torch Adam state and asserts there is exactly
    one value (distrib_optimizer.py:837-840). A resumed run calls it on a fresh optimizer, whose state is
    empty (``sharded_state_dict(is_loading=True)`` builds its load template from it), so ``--load`` fails
    with a bare ``AssertionError``. The wrapper first gives an optimizer with no state at all the state
    torch's Adam would create on its first step: step 0 and zero moments, so nothing changes for training
    (Adam treats it exactly like a fresh state), and the load then overwrites it from the checkpoint.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.state_dict

    @functools.wraps(original)
    def state_dict(self):
        if isinstance(self.optimizer, torch.optim.Optimizer) and not self.optimizer.state:
            _initialise_adam_state(self.optimizer)
        return original(self)

    replace_attr(DistributedOptimizer, "state_dict", state_dict)


@_distopt_fix("distopt_step_per_param", "load_state_dict")
def distopt_step_per_param() -> None:
    """Give each parameter its own Adam ``step`` tensor after ``DistributedOptimizer.load_state_dict()``.

    Without TE/apex, ``load_state_dict`` puts one tensor, ``torch.tensor(step)``, into every parameter's
    state (distrib_optimizer.py:1025-1032), and ``torch.optim.Optimizer.load_state_dict`` keeps ``step``
    tensors as they are. Adam increments ``state['step']`` in place once per parameter, so after a resume
    the shared counter advances by the number of parameters each iteration and the bias corrections
    ``1 - beta**step`` are wrong: the first resumed iteration's loss matches, every later one drifts, with
    no error. The wrapper replaces each parameter's ``step`` by its own copy after the original ran.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.load_state_dict

    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        original(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    replace_attr(DistributedOptimizer, "load_state_dict", load_state_dict)


@_distopt_fix("distopt_load_moments_only", "_set_main_param_and_optimizer_states")
def distopt_load_moments_only() -> None:
    """Load the main parameter and the Adam moments of a shard under ``torch.no_grad()``, never ``step``.

    ``_set_main_param_and_optimizer_states`` (distrib_optimizer.py:1193-1225) copies every tensor of the
    Adam state from the checkpoint's, ``step`` included. Two faults without TE/apex:

    * ``step`` is not in the checkpoint's parameter state (the step lives in the parameter groups and is
      set by ``load_state_dict``, l.1025-1032). The ``dp_reshardable`` loader (the default format) hands
      over the load template's ``step``, the value of the *fresh* optimizer, so the resumed run restarts
      Adam's bias correction at step 1: the first resumed iteration matches, the later ones drift, silently.
      The ``fully_reshardable`` and model-space loaders leave ``step`` out, and the original then fails
      with ``KeyError: 'step'``.
    * For fp32 model parameters the optimizer's parameter is a view of the model parameter (l.466-467),
      and torch refuses an in-place ``copy_()`` into a view of a leaf that requires grad.

    The replacement copies every state tensor but ``step`` under ``torch.no_grad()``, as the model-space
    loader next to it already runs. The precision-aware optimizer (TE only) keeps the original.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    @functools.wraps(original)
    @torch.no_grad()
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        destinations = {"param": main_param, **self.optimizer.state[main_param]}
        for key, destination in destinations.items():
            if key != "step" and torch.is_tensor(destination) and torch.is_tensor(tensors[key]):
                destination.copy_(tensors[key])

    replace_attr(DistributedOptimizer, "_set_main_param_and_optimizer_states", _set_main_param_and_optimizer_states)


def _mixes_optimizer_splits(state_dict) -> bool:
    """A loaded ``ChainedOptimizer`` state that merges two splits: the saved one and this run's template.

    ``dist_checkpointing.load`` merges the checkpoint's common state (shaped like the *saved* chain: one
    optimizer's keys, or one integer key per part) with the tensors loaded into this run's template
    (shaped like *this* chain). Equal splits give only string or only integer keys; different ones both.
    """
    return (isinstance(state_dict, dict) and any(isinstance(k, int) for k in state_dict)
            and any(isinstance(k, str) for k in state_dict))  # fmt: skip


@register("megatron_fixes.optimizer_split_changed", megatron=">=0.19,<0.20",
          target="megatron.core.optimizer.optimizer.ChainedOptimizer.load_state_dict")
def optimizer_split_changed() -> None:
    """Refuse, in one line, optimizer state saved with another split into dense and expert optimizers.

    Megatron builds one optimizer for the dense parameters and, when experts are parallel in their own way
    (expert parallelism > 1, or expert tensor parallelism different from TP), a second one for the experts
    (``get_megatron_optimizer``, ``param.allreduce``). A checkpoint saved with one part and loaded with two,
    or the reverse (TP1/EP1 -> EP2, TP2/ETP1 -> TP1, ...), fails deep in ``ChainedOptimizer.load_state_dict``
    with ``RuntimeError: Expected 2 entries in state dict, but got 4`` (or a ``KeyError``): Megatron 0.19
    cannot move the Adam state and parameter groups between the parts. ZAYA1's experts have their own
    optimizer in every layout (``megatron_zaya/model/experts.py``), so its checkpoints reshard across EP sizes;
    this meets checkpoints saved before that (experts in the dense optimizer at EP1). The wrapper detects the
    mismatch first and raises ``UsageError`` (``zaya-pretrain`` prints one line and exits 2) naming the way out.

    Off: leave ``megatron_fixes.optimizer_split_changed`` out of ``--zaya-patches`` / ``ZAYA_PATCHES``.
    """
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    from megatron_zaya.errors import UsageError

    original = ChainedOptimizer.load_state_dict

    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        if _mixes_optimizer_splits(state_dict):
            raise UsageError(
                "the checkpoint's optimizer state is split into dense and expert parts differently from this run "
                "(it was saved by an older megatron-zaya, which kept the experts in the dense optimizer at expert "
                "parallelism 1); load the weights only with --no-load-optim"
            )
        return original(self, state_dict)

    replace_attr(ChainedOptimizer, "load_state_dict", load_state_dict)


@register("megatron_fixes.first_log_resets", megatron=">=0.19,<0.20",
          target="megatron.training.training.training_log")
def first_log_resets() -> None:
    """Reset the logged loss sums after a launch's first iteration when it falls on a log interval.

    ``training_log`` always prints a launch's first iteration (``is_first_iteration``, training.py:2594) and
    then keeps its sums so that an interval it cut short still averages every iteration of it. When the
    first iteration is itself on the interval (every launch with ``--log-interval 1``, and a resume on the
    interval), nothing is cut short, yet the sums are kept: the next logged ``lm loss`` is the mean of two
    iterations, a step that did not happen. The wrapper passes ``is_first_iteration=False`` there, which
    also lets that iteration's timers reach TensorBoard like any other logged iteration's.

    Off: leave ``megatron_fixes.first_log_resets`` out of ``--zaya-patches`` / ``ZAYA_PATCHES``.
    """
    import megatron.training.training as training

    original = training.training_log

    @functools.wraps(original)
    def training_log(*args, is_first_iteration=False, **kwargs):
        iteration = args[3] if len(args) > 3 else kwargs["iteration"]
        if is_first_iteration and iteration % training.get_args().log_interval == 0:
            is_first_iteration = False
        return original(*args, is_first_iteration=is_first_iteration, **kwargs)

    replace_attr(training, "training_log", training_log)


@register("megatron_fixes.untracked_tensor_logs", megatron=">=0.19,<0.20",
          target="megatron.core.optimizer.optimizer.get_param_id_to_sharded_param_map")
def untracked_tensor_logs() -> None:
    """A checkpoint save no longer formats every model tensor that one of the optimizers does not track.

    ``get_param_id_to_sharded_param_map`` (dist_checkpointing/optimizer.py:70), which Megatron's optimizers call
    from their ``sharded_state_dict`` (optimizer.py:1150, 1365), builds ``logger.debug(f'{ten} is not tracked
    by the optimizer')`` for each model tensor it is given but the optimizer does not hold, whether or not debug
    logging is on; the f-string formats the ``ShardedTensor`` with its values (a device-to-host read on a GPU).
    A chained optimizer gives each part the whole model, so each save formats every tensor of the other
    parts (2,452 for the 8-layer ZAYA1 with Muon and Adam) while the training loop waits. The wrapper passes
    only the optimizer's own tensors (:func:`~megatron_zaya.optim.megatron.tracked_sharded_tensors`): the
    same map, nothing formatted. ZAYA1's Muon wrapper already passes its own.

    Off: leave ``megatron_fixes.untracked_tensor_logs`` out of ``--zaya-patches`` / ``ZAYA_PATCHES``.
    """
    from megatron.core.optimizer import optimizer

    from megatron_zaya.optim.megatron import tracked_sharded_tensors

    original = optimizer.get_param_id_to_sharded_param_map

    @functools.wraps(original)
    def get_param_id_to_sharded_param_map(model_sharded_state_dict, optim_params_iter):
        params = list(optim_params_iter)
        return original(tracked_sharded_tensors(model_sharded_state_dict, params), params)

    replace_attr(optimizer, "get_param_id_to_sharded_param_map", get_param_id_to_sharded_param_map)


_SCHEDULE_FLAGS = {  # OptimizerParamScheduler's name of a value -> the flag behind it
    "learning rate": "--lr", "minimum learning rate": "--min-lr", "warmup iterations": "--lr-warmup-iters",
    "total number of iterations": "--lr-decay-iters (default: --train-iters)",
    "learning rate decay style": "--lr-decay-style", "start weight decay": "--start-weight-decay",
    "end weight decay": "--end-weight-decay",
    "total number of weight decay iterations": "--weight-decay-incr-style length (--train-iters)",
}


@register("megatron_fixes.schedule_mismatch", megatron=">=0.19,<0.20",
          target="megatron.core.optimizer_param_scheduler.OptimizerParamScheduler._check_and_set")
def schedule_mismatch() -> None:
    """Refuse, in one line, a resume whose LR or weight-decay schedule differs from the checkpoint's.

    ``OptimizerParamScheduler.load_state_dict`` compares each schedule value with the checkpoint's and fails
    with a bare ``AssertionError`` ("class input value 24 and checkpointvalue 32 for total number of
    iterations do not match", in samples) when they differ, e.g. after raising ``--train-iters`` to continue
    a finished run. The replacement raises ``UsageError`` (``zaya-pretrain`` prints one line, exit 2) naming
    the flag and both ways out.

    Off: leave ``megatron_fixes.schedule_mismatch`` out of ``--zaya-patches`` / ``ZAYA_PATCHES``.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_zaya.errors import UsageError

    original = OptimizerParamScheduler._check_and_set

    @functools.wraps(original)
    def _check_and_set(self, cls_value, sd_value, name):
        if not (self.override_opt_param_scheduler or self.use_checkpoint_opt_param_scheduler) and cls_value != sd_value:
            raise UsageError(
                f"the checkpoint's schedule has {name} {sd_value}, this run's flags give {cls_value} (flag: "
                f"{_SCHEDULE_FLAGS.get(name, name)}; iteration counts are in samples); add "
                "--override-opt_param-scheduler to use this run's schedule, or --use-checkpoint-opt_param-scheduler "
                "to keep the checkpoint's")
        return original(self, cls_value, sd_value, name)

    replace_attr(OptimizerParamScheduler, "_check_and_set", _check_and_set)
