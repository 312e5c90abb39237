"""Faults for the reliability tests, injected into a zaya-pretrain process from outside megatron_zaya's code.

A test puts this folder first on the process's PYTHONPATH and sets ``ZAYA_FAULT_INJECT="kind@iteration[@rank],..."``
(``zaya_cli.with_faults``). Python imports this module at start-up; when ``megatron_zaya.training.reliability`` is
imported, its :class:`StepGuard` is wrapped so that the given (1-based) iteration, on every rank or only on ``rank``
(global rank), is broken:

* ``nan_loss`` / ``inf_loss``: the micro-batch losses of that iteration become NaN / +Inf (and so do their grads);
* ``loss_spike``: the losses of that iteration are multiplied by 10;
* ``nan_grad`` / ``inf_grad``: one gradient element becomes NaN / +Inf after the gradient all-reduce;
* ``drift``: one weight of this rank changes by +1 (data-parallel replicas disagree from then on);
* ``hang``: the forward of that iteration never returns, in a launch that torchrun has not restarted yet;
* ``crash``: the forward of that iteration raises, in every launch (a crash loop);
* ``first_crash``: the same, in a launch that torchrun has not restarted yet.

``bad_gemm@0[@rank]`` breaks the node self-test before training instead: its GEMM returns one wrong element.

``setup_hang@0`` hangs the set-up between the optimizer's creation (the watchdog's start) and the training loop:
Megatron's building of the data iterators never returns, in a launch that torchrun has not restarted yet.
``slow_load@0`` makes Megatron's checkpoint load at start-up take :data:`SLOW_LOAD_SECONDS` longer.

``slow_write@iteration`` instead delays the background writer (``--async-save``): its write of that checkpoint
starts :data:`SLOW_WRITE_SECONDS` late, so that the steps after it reach the next save while it is in flight.

``kill_after_save@iteration`` SIGKILLs the process as Megatron's save of that iteration returns: a synchronous
save has named it in the tracker file, and nothing after the save has run.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import math
import os
import sys

ENV_VAR = "ZAYA_FAULT_INJECT"
STEP_KINDS = ("nan_loss", "inf_loss", "loss_spike", "nan_grad", "inf_grad", "drift", "hang", "crash", "first_crash")
WRITE_KINDS = ("slow_write",)
SAVE_KINDS = ("kill_after_save",)
NODE_KINDS = ("bad_gemm",)
SETUP_KINDS = ("setup_hang",)
LOAD_KINDS = ("slow_load",)
SLOW_WRITE_SECONDS = 5.0
SLOW_LOAD_SECONDS = 25.0


@functools.cache
def _plan() -> tuple[tuple[str, int, int | None], ...]:
    faults = []
    for item in (s.strip() for s in os.environ.get(ENV_VAR, "").split(",") if s.strip()):
        kind, _, rest = item.partition("@")
        iteration, _, rank = rest.partition("@")
        kinds = STEP_KINDS + WRITE_KINDS + NODE_KINDS + SAVE_KINDS + SETUP_KINDS + LOAD_KINDS
        if kind not in kinds or not iteration.isdigit() or (rank and not rank.isdigit()):
            raise ValueError(f"{ENV_VAR}: bad entry {item!r}; use kind@iteration[@rank], kind one of "
                             f"{', '.join(kinds)}")
        faults.append((kind, int(iteration), int(rank) if rank else None))
    return tuple(faults)


def _asked(kind: str) -> bool:
    """Whether ``kind`` is asked for at the current iteration on this rank."""
    import torch.distributed as dist
    from megatron.training import get_args

    iteration, rank = get_args().curr_iteration + 1, dist.get_rank() if dist.is_initialized() else 0
    return any(k == kind and i == iteration and r in (None, rank) for k, i, r in _plan())


def _poisoned(loss_func, output):
    import torch

    loss, num_tokens, report = loss_func(output)
    if torch.is_grad_enabled():  # training, not evaluation
        for kind, factor in (("nan_loss", math.nan), ("inf_loss", math.inf), ("loss_spike", 10.0)):
            if _asked(kind):
                loss = loss * factor
                report = {**report, "lm loss": torch.cat([loss.detach().view(1), report["lm loss"][1:]])}
    return loss, num_tokens, report


def _break_grads(optimizer, model_chunks) -> None:
    import torch

    for kind, value in (("nan_grad", math.nan), ("inf_grad", math.inf)):
        if _asked(kind):
            next(p.grad for p in optimizer.get_parameters() if p.grad is not None).view(-1)[0] = value
    if _asked("drift"):
        with torch.no_grad():
            next(p for chunk in model_chunks for p in chunk.parameters()).view(-1)[0] += 1.0


def _wrap_step_guard(module) -> None:
    """Loss faults enter through the forward step the guard watches; gradient and weight faults right after
    ``prepare_grads`` (gradients final, before the guard reads the norm and compares replicas)."""
    step_guard = module.StepGuard
    install, watch = step_guard.install, step_guard.watch

    def install_with_faults(self, optimizer, model_chunks, args):
        prepare_grads = optimizer.prepare_grads

        def prepare_grads_with_faults():
            overflow = prepare_grads()
            _break_grads(optimizer, model_chunks)
            return overflow

        optimizer.prepare_grads = prepare_grads_with_faults
        install(self, optimizer, model_chunks, args)

    def watch_with_faults(self, forward_step):
        @functools.wraps(forward_step)
        def forward_step_with_faults(*args, **kwargs):
            first_launch = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            if _asked("hang") and first_launch:
                import time

                time.sleep(24 * 3600)
            if _asked("crash") or (_asked("first_crash") and first_launch):
                raise RuntimeError(f"injected fault ({ENV_VAR})")
            output, loss_func = forward_step(*args, **kwargs)
            return output, functools.partial(_poisoned, loss_func)

        return watch(self, forward_step_with_faults)

    step_guard.install, step_guard.watch = install_with_faults, watch_with_faults


def _wrap_writer(module) -> None:
    """Delay the background save's write of each ``slow_write`` checkpoint, once its copies to host memory are
    done (the training loop does not wait for it)."""
    import time

    from megatron_zaya.checkpoint import step_name

    slow = {step_name(iteration) for kind, iteration, _ in _plan() if kind == "slow_write"}
    write_from_host = module.write_from_host

    def slowed(write):
        def write_later(*args):
            time.sleep(SLOW_WRITE_SECONDS)
            return write(*args)

        return write_later

    @functools.wraps(write_from_host)
    def write_slowly(snapshot, write, rank, write_buckets, results_queue, written):
        if any(part in slow for part in os.path.normpath(write_buckets[0][0]).split(os.sep)):
            write = slowed(write)
        return write_from_host(snapshot, write, rank, write_buckets, results_queue, written)

    module.write_from_host = write_slowly


def _wrap_self_test(module) -> None:
    """One wrong element in the self-test's GEMM on the ranks ``bad_gemm`` names."""
    rank = int(os.environ.get("RANK", "0"))
    if not any(kind == "bad_gemm" and r in (None, rank) for kind, _, r in _plan()):
        return
    gemm = module._device_gemm

    def bad_gemm(a, b):
        product = gemm(a, b)
        product.view(-1)[0] += 1e3
        return product

    module._device_gemm = bad_gemm


def _wrap_save(module) -> None:
    """SIGKILL at the return of each ``kill_after_save`` iteration's save (``save_checkpoint(iteration, ...)``)."""
    import signal

    killed_at = {iteration for kind, iteration, _ in _plan() if kind == "kill_after_save"}
    save_checkpoint = module.save_checkpoint

    @functools.wraps(save_checkpoint)
    def save_then_die(iteration, *args, **kwargs):
        saved = save_checkpoint(iteration, *args, **kwargs)
        if iteration in killed_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return saved

    module.save_checkpoint = save_then_die


def _wrap_setup(module) -> None:
    """Hang Megatron's building of the data iterators (``pretrain`` looks the name up in its module when it calls it)
    in the first launch."""
    import time

    build = module.build_train_valid_test_data_iterators

    @functools.wraps(build)
    def build_never_returns(*args, **kwargs):
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            time.sleep(24 * 3600)
        return build(*args, **kwargs)

    module.build_train_valid_test_data_iterators = build_never_returns


def _wrap_load(module) -> None:
    """Delay ``load_checkpoint`` by :data:`SLOW_LOAD_SECONDS`, as a large checkpoint on slow storage takes."""
    import time

    load_checkpoint = module.load_checkpoint

    @functools.wraps(load_checkpoint)
    def load_slowly(*args, **kwargs):
        time.sleep(SLOW_LOAD_SECONDS)
        return load_checkpoint(*args, **kwargs)

    module.load_checkpoint = load_slowly


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands the ``target`` module's spec on with a loader that applies ``wrap`` to it once
    executed."""

    def __init__(self, target: str, wrap) -> None:
        self.target, self.wrap = target, wrap

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            self.wrap(module)

        spec.loader.exec_module = exec_module
        return spec


if any(kind in STEP_KINDS for kind, _, _ in _plan()):
    sys.meta_path.insert(0, _WrapOnImport("megatron_zaya.training.reliability", _wrap_step_guard))
if any(kind in NODE_KINDS for kind, _, _ in _plan()):
    sys.meta_path.insert(0, _WrapOnImport("megatron_zaya.training.health", _wrap_self_test))
if any(kind in SAVE_KINDS for kind, _, _ in _plan()):  # before megatron.training.training imports the name
    sys.meta_path.insert(0, _WrapOnImport("megatron.training.checkpointing", _wrap_save))
if any(kind in WRITE_KINDS for kind, _, _ in _plan()):
    sys.meta_path.insert(0, _WrapOnImport("megatron_zaya.checkpoint.staging", _wrap_writer))
if any(kind in SETUP_KINDS for kind, _, _ in _plan()):
    sys.meta_path.insert(0, _WrapOnImport("megatron.training.training", _wrap_setup))
if any(kind in LOAD_KINDS for kind, _, _ in _plan()):  # before megatron.training.training imports the name
    sys.meta_path.insert(0, _WrapOnImport("megatron.training.checkpointing", _wrap_load))
