"""Training that survives faults: non-finite steps, loss spikes, replica drift, pre-emption.

What happens on each fault, how the tests inject it, and the flags, are in ``docs/reliability.md``.

* :class:`StepGuard` sits in Megatron's optimizer step (installed by the ``reliability.step_guard`` patch):
  after the gradients are ready and before any update it reads the global grad norm (Megatron computes it
  for clipping anyway; it is reduced over every rank holding gradients) and the global loss of the step.
  A non-finite value skips the step the way Megatron's fp16 loss scaler does (``prepare_grads`` reports
  an overflow, ``train_step`` counts a skipped iteration, the LR schedule does not advance) and also undoes
  the step's balancing-bias update. ``--zaya-max-nonfinite-steps`` skipped steps in a row stop the run.
  Every ``--zaya-replica-check-interval`` steps it compares per-tensor checksums of the weights across
  data-parallel replicas.
* :func:`arm_sigterm_deadline` bounds the time between SIGTERM and the exit.
* The progress watchdog (``--zaya-watchdog-seconds``, ``watchdog.py``) hears the guard's beats: each micro-batch's
  forward and each optimizer step. A launch's first step and a hang go into the event ledger (``ledger.py``).
"""

from __future__ import annotations

import collections
import functools
import math
import os
import signal
import sys
import threading
from pathlib import Path

import torch

from ..checkpoint.format import describe_latest_checkpoint, read_tracker
from ..errors import TrainingFault
from ..runtime import on_any_rank, print_rank_0
from .ledger import LEDGER
from .watchdog import WATCHDOG

FAULT_EXIT_CODE = 3


def _iteration() -> int:
    """The iteration running: one past those done. Before the training loop (checkpoint load, data loaders), the
    first it will run."""
    from megatron.training import get_args

    args = get_args()
    done = getattr(args, "curr_iteration", None)  # set by the training loop at each iteration
    return (getattr(args, "iteration", 0) if done is None else done) + 1


def _where() -> str:
    """Where a rank is, for the watchdog's line: in an iteration, or still setting up before the first."""
    from megatron.training import get_args

    if getattr(get_args(), "curr_iteration", None) is None:
        return " while setting up, before its first step (data loaders)"
    return f" in iteration {_iteration()}"


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class StepGuard:
    """Per-step fault checks inside the optimizer step; one instance (:data:`GUARD`) per process."""

    def __init__(self):
        self.max_nonfinite = 0
        self.spike_sigma = 0.0
        self.replica_interval = 0
        self.save_dir = None
        self.skipped_in_a_row = 0
        self.skipped_total = 0
        self.losses = collections.deque()
        self._balancing: list[torch.Tensor] = []
        self._balancing_snapshot: list[torch.Tensor] = []
        self._step_iteration = None
        self._loss = torch.zeros(2, dtype=torch.float64)  # summed loss, tokens of this step on this rank
        self.at_first_step = lambda: None  # called once, in the main thread (arm_sigterm_deadline)

    # ------------------------------------------------------------------------------------------ setup
    def install(self, optimizer, model_chunks, args) -> None:
        """Wrap ``optimizer.prepare_grads`` (every Megatron optimizer's step calls it before the update)."""
        from .balancing import routers

        self.max_nonfinite = args.zaya_max_nonfinite_steps
        self.spike_sigma = args.zaya_loss_spike_sigma
        self.losses = collections.deque(maxlen=args.zaya_loss_spike_window)
        self.replica_interval = args.zaya_replica_check_interval
        self.save_dir = args.save
        self.model_chunks = model_chunks
        self._balancing = [buffer for router in routers(model_chunks) for buffer in (
            router.balancing_biases, router.balancing_exp_avg, router.balancing_exp_avg_sq, router.balancing_step)]
        prepare_grads, get_grad_norm = optimizer.prepare_grads, optimizer.get_grad_norm
        cached_norm = []

        def record_hang(silent: float, cause: str) -> None:
            saved = read_tracker(args.save) if args.save else None
            LEDGER.failure("hang", _iteration(), cause, saved, seconds=silent)

        recorder_dir = Path(args.save) / "flight-recorder" / LEDGER.launch.replace("/", "+") if args.save else None
        WATCHDOG.arm(args.zaya_watchdog_seconds, describe=_where, on_hang=record_hang, recorder_dir=recorder_dir)

        @functools.wraps(prepare_grads)
        def guarded_prepare_grads() -> bool:
            WATCHDOG.beat(step_done=True)
            overflow = prepare_grads()  # True: fp16 loss scaling found an overflow and Megatron skips already
            if overflow:
                return True
            iteration = _iteration()
            if self.replica_interval and iteration % self.replica_interval == 0:
                check_replicas(self.model_chunks, iteration, self.save_dir)
            cached_norm[:] = [get_grad_norm()]
            return self._skip_step(iteration, cached_norm[0])

        @functools.wraps(get_grad_norm)
        def get_grad_norm_once():
            return cached_norm.pop() if cached_norm else get_grad_norm()  # step() asks right after prepare_grads

        optimizer.prepare_grads = guarded_prepare_grads
        optimizer.get_grad_norm = get_grad_norm_once

    def watch(self, forward_step):
        """``forward_step`` that snapshots the balancing state at a step's first micro-batch (on every pipeline
        stage) and records the step's loss."""

        @functools.wraps(forward_step)
        def watched_forward_step(data_iterator, model, *args, **kwargs):
            WATCHDOG.beat()
            if torch.is_grad_enabled() and _iteration() != self._step_iteration:  # not evaluation; every stage
                if self._step_iteration is None:
                    self.at_first_step()
                    LEDGER.first_step(_iteration())
                self._start_step(_iteration())
            output, loss_func = forward_step(data_iterator, model, *args, **kwargs)
            return output, functools.partial(self._record_loss, loss_func)

        return watched_forward_step

    # ------------------------------------------------------------------------------------- per step
    def _start_step(self, iteration: int) -> None:
        """First micro-batch of a step: remember the balancing state this step's bias update starts from."""
        self._step_iteration = iteration
        self._loss = torch.zeros(2, dtype=torch.float64, device=_device())
        if self._balancing:
            if not self._balancing_snapshot:
                self._balancing_snapshot = [b.clone() for b in self._balancing]
            torch._foreach_copy_(self._balancing_snapshot, self._balancing)

    def _record_loss(self, loss_func, output):
        loss, num_tokens, report = loss_func(output)
        if not torch.is_grad_enabled():  # evaluation
            return loss, num_tokens, report
        self._loss += torch.stack([loss.detach().double(), num_tokens.detach().double()])
        return loss, num_tokens, report

    def _skip_step(self, iteration: int, grad_norm) -> bool:
        """After the gradients are final, before the update: True skips the step."""
        # One all-reduce over every rank: the step's loss and tokens, and how many ranks saw a non-finite
        # grad norm (with DDP the norm is not reduced over data-parallel ranks), so all ranks decide alike.
        local = self._loss if self._step_iteration == iteration else torch.zeros(2, dtype=torch.float64,
                                                                                  device=_device())
        bad_norm = grad_norm is None or not math.isfinite(grad_norm)
        step = torch.cat([local, torch.tensor([float(bad_norm)], dtype=torch.float64, device=local.device)])
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(step)
        loss_sum, tokens, ranks_with_bad_norm = step.tolist()
        loss = loss_sum / max(tokens, 1.0)
        if math.isfinite(loss) and not ranks_with_bad_norm:
            self.skipped_in_a_row = 0
            self._watch_spikes(iteration, loss, tokens > 0)
            return False
        self._undo_balancing()
        self.skipped_in_a_row += 1
        self.skipped_total += 1
        print_rank_0(f" [zaya] iteration {iteration:8d} | non-finite step skipped (loss {loss}, grad norm "
                     f"{grad_norm}, ranks with a non-finite grad norm: {ranks_with_bad_norm:.0f}) "
                     f"| skipped in a row: {self.skipped_in_a_row} | skipped in total: {self.skipped_total} |")
        if self.max_nonfinite and self.skipped_in_a_row >= self.max_nonfinite:
            first = iteration - self.skipped_in_a_row + 1
            raise TrainingFault(
                f"{self.skipped_in_a_row} steps in a row (iterations {first}-{iteration}) had a non-finite loss or "
                f"gradient and were skipped (--zaya-max-nonfinite-steps {self.max_nonfinite}), so none of them reached "
                f"the weights; resume from the last checkpoint with a lower --lr or past the bad data "
                f"(--iterations-to-skip {' '.join(map(str, range(first, iteration + 1)))}); last checkpoint: "
                f"{describe_latest_checkpoint(self.save_dir)}")
        return True

    def _undo_balancing(self) -> None:
        if self._balancing_snapshot:
            torch._foreach_copy_(self._balancing, self._balancing_snapshot)

    def _watch_spikes(self, iteration: int, loss: float, has_loss: bool) -> None:
        """Log a loss more than ``--zaya-loss-spike-sigma`` standard deviations above the recent window."""
        if not (self.spike_sigma and has_loss):
            return
        window = self.losses
        if len(window) >= max(2, window.maxlen // 4):
            mean = sum(window) / len(window)
            std = math.sqrt(sum((x - mean) ** 2 for x in window) / (len(window) - 1))
            if std > 0 and loss > mean + self.spike_sigma * std:
                print_rank_0(f" [zaya] iteration {iteration:8d} | loss spike: {loss:.4f} is {(loss - mean) / std:.1f} "
                             f"sigma above the mean {mean:.4f} of the last {len(window)} steps |")
        window.append(loss)


GUARD = StepGuard()


# ---------------------------------------------------------------------------------------- replica drift
def check_replicas(model_chunks, iteration: int, save_dir: str | None) -> None:
    """Raise :class:`TrainingFault` on every rank if data-parallel replicas hold different weights.

    Each rank sums every weight tensor (float64 accumulation, one reduction per tensor) and all-gathers the
    sums over its data-parallel group (expert tensors: the expert-data-parallel group): replicas are
    bit-identical, so their sums are too. Run before the update, when every rank holds the weights it
    just used (also with the distributed optimizer's overlapped parameter all-gather).
    """
    from megatron.core import parallel_state as mpu

    named = [(name.removeprefix("module.").removeprefix("module."), p)
             for chunk in model_chunks for name, p in chunk.named_parameters()]
    dense = [(n, p) for n, p in named if getattr(p, "allreduce", True)]  # Megatron marks expert weights False
    experts = [(n, p) for n, p in named if not getattr(p, "allreduce", True)]
    groups = ((mpu.get_data_parallel_group(with_context_parallel=True), dense),
              (mpu.get_expert_data_parallel_group(), experts))
    problems = []
    for group, params in groups:
        size = torch.distributed.get_world_size(group)
        if size == 1 or not params:
            continue
        sums = torch.stack([torch.sum(p.detach(), dtype=torch.float64) for _, p in params])
        gathered = [torch.empty_like(sums) for _ in range(size)]
        torch.distributed.all_gather(gathered, sums, group=group)
        table = torch.stack(gathered)
        for other in range(1, size):
            differing = (table[other] != table[0]).nonzero().flatten().tolist()
            if differing:
                problems.append(f"rank {torch.distributed.get_global_rank(group, other)} differs from rank "
                                f"{torch.distributed.get_global_rank(group, 0)} in {params[differing[0]][0]}"
                                + (f" and {len(differing) - 1} more tensors" if len(differing) > 1 else ""))
    if on_any_rank(bool(problems)):  # every rank stops, not just the group
        raise TrainingFault(
            f"data-parallel replicas hold different weights at iteration {iteration} "
            f"({'; '.join(problems) or 'seen by other ranks'}): a silent hardware or communication fault; "
            f"check the nodes involved and restart from the last checkpoint: {describe_latest_checkpoint(save_dir)}")
    print_rank_0(f" [zaya] iteration {iteration:8d} | data-parallel replicas identical |")


# ---------------------------------------------------------------------------------------------- SIGTERM
def saves_on_sigterm(save_dir: str | None, deadline: float) -> bool:
    """Whether SIGTERM (pre-emption, scancel) saves: with a --save directory, unless --zaya-sigterm-deadline is 0
    (zaya-pretrain then gives Megatron ``--exit-signal-handler`` and arms the deadline)."""
    return bool(save_dir) and deadline > 0


def arm_sigterm_deadline(seconds: float, save_dir: str | None, exit=os._exit) -> None:
    """After SIGTERM (Megatron's ``--exit-signal-handler`` saves at the end of the current step and exits 0),
    give the save ``seconds``; past them print why and exit with :data:`FAULT_EXIT_CODE`, before the
    scheduler's SIGKILL. The ``latest`` marker is replaced atomically, so the last complete checkpoint stays.
    SIGINT (Ctrl-C) does the same, instead of a KeyboardInterrupt that would lose the steps since the last save.

    Until the first training step SIGTERM keeps its default action, which ends the process at once: there is
    nothing new to save yet, and a start-up waiting in C (for a peer that failed its self-test, in the store or a
    collective) would run no Python handler. :data:`GUARD` installs the handler at the first step. SIGINT's is
    installed at once: the data-loader workers forked before the first step inherit it (Megatron gives them a
    SIGTERM handler of their own), and a terminal's Ctrl-C reaches them too."""
    previous = signal.getsignal(signal.SIGTERM)

    def on_signal(signum, frame):
        def expire():
            print(f"zaya-pretrain: error: {signal.Signals(signum).name}: the checkpoint did not finish within "
                  f"--zaya-sigterm-deadline {seconds:g} s; exiting without it; the last complete checkpoint: "
                  f"{describe_latest_checkpoint(save_dir)}",
                  file=sys.stderr, flush=True)
            exit(FAULT_EXIT_CODE)

        timer = threading.Timer(seconds, expire)
        timer.daemon = True
        try:
            timer.start()
        except RuntimeError:  # no new thread while the interpreter exits: it is ending already
            return
        if callable(previous):
            previous(signal.SIGTERM, frame)  # Megatron's handler: save at the end of the step

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, on_signal)
    GUARD.at_first_step = lambda: signal.signal(signal.SIGTERM, on_signal)
