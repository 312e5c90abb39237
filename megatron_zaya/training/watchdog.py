"""The progress watchdog of ``--zaya-watchdog-seconds T``: a rank whose training stops making progress writes every
thread's stack to its log and exits with :data:`HANG_EXIT_CODE`, so that torchrun's elastic agent
(``--max-restarts``) restarts the group from the newest intact checkpoint, instead of every rank waiting for the
collective timeout (10 minutes by default) and then ending the job.

Progress is a beat: each micro-batch's forward (training and evaluation) and each optimizer step
(:class:`~megatron_zaya.training.reliability.StepGuard` gives them). A rank hangs when no beat came for longer
than its allowance:

* until the first optimizer step, ``FIRST_STEP_ALLOWANCE * T`` (from the optimizer's creation: data loaders, kernel
  compilation, graph capture);
* then ``T``, or ``SLOW_STEP_FACTOR`` times the longest gap between beats measured so far (the first step's,
  compilation included) when that is longer: a run whose steps are merely slow is not a hang;
* never while a checkpoint is being saved or loaded (:meth:`ProgressWatchdog.paused`).

Before it exits, a hung rank also writes torch's flight recorder, the last collectives of each of its process groups
and how far each got (:func:`dump_flight_recorder`): the stacks say where a rank waits, the recorder in which
collective, and, read across ranks with ``python -m torch.distributed.flight_recorder.fr_trace``, which rank never
joined it. :func:`record_collectives` turns the recorder on for runs with a watchdog.

Off by default (``T = 0``). How to choose T: docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from pathlib import Path

HANG_EXIT_CODE = 4
FIRST_STEP_ALLOWANCE = 10
SLOW_STEP_FACTOR = 4
FLIGHT_RECORDER_ENTRIES = 2000
FLIGHT_RECORDER_SECONDS = 10  # a dump that takes longer (a communicator too stuck to report) is given up


def record_collectives() -> None:
    """Have torch's flight recorder keep the last :data:`FLIGHT_RECORDER_ENTRIES` collectives of every process
    group (NCCL's; gloo's too on torch that records them). Before the process groups are created; a size the user
    set wins. (Older torch reads the NCCL name, newer the generic one.)"""
    if "TORCH_FR_BUFFER_SIZE" not in os.environ and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        os.environ["TORCH_FR_BUFFER_SIZE"] = os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] = str(FLIGHT_RECORDER_ENTRIES)


def dump_flight_recorder(directory: str | os.PathLike) -> Path | None:
    """Write this rank's flight recorder to ``directory/rank_<rank>`` (the name torch's ``fr_trace`` reads); None
    when torch has none for the run's backend, it records nothing, or the dump does not finish in
    :data:`FLIGHT_RECORDER_SECONDS`."""
    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d

    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    dump = getattr(c10d, "_dump_nccl_trace" if nccl else "_dump_fr_trace", None)
    if dump is None:
        return None
    path = Path(directory) / f"rank_{os.environ.get('RANK', '0')}"
    result: list[bytes] = []
    worker = threading.Thread(target=lambda: result.append(dump()), name="zaya-flight-recorder", daemon=True)
    worker.start()
    worker.join(FLIGHT_RECORDER_SECONDS)
    if not result or b"entries" not in result[0]:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(result[0])
    return path


class ProgressWatchdog:
    """One per process (:data:`WATCHDOG`); ``arm`` starts its thread, ``beat`` marks progress."""

    def __init__(self, clock=time.monotonic, exit=os._exit, stream=None):
        self._clock, self._exit, self._stream = clock, exit, stream
        self._lock = threading.Lock()
        self.seconds = 0.0
        self._last = 0.0
        self._longest_gap = 0.0
        self._beaten = self._stepped = False
        self._pauses = 0
        self._describe = lambda: ""
        self._on_hang = lambda silent, cause: None
        self._recorder_dir = None

    def arm(self, seconds: float, describe=lambda: "", on_hang=lambda silent, cause: None,
            recorder_dir: str | os.PathLike | None = None) -> None:
        """Watch from now on; ``describe()`` names where the run is (e.g. the iteration) in the hang's line,
        ``on_hang(seconds without progress, cause)`` records a hang before the exit, and the flight recorder is
        written into ``recorder_dir`` (none without one)."""
        if seconds <= 0 or self.seconds > 0:
            return
        self.seconds, self._describe, self._on_hang, self._last = seconds, describe, on_hang, self._clock()
        self._recorder_dir = recorder_dir
        threading.Thread(target=self._watch, name="zaya-watchdog", daemon=True).start()

    def beat(self, step_done: bool = False) -> None:
        now = self._clock()
        with self._lock:
            if self._beaten:  # gaps between beats: the set-up before the first one (data loaders) is no step
                self._longest_gap = max(self._longest_gap, now - self._last)
            self._beaten = True
            self._stepped |= step_done
            self._last = now

    @contextlib.contextmanager
    def paused(self):
        """No hang is declared inside (a checkpoint save or load); the gap restarts at its end."""
        with self._lock:
            self._pauses += 1
        try:
            yield
        finally:
            with self._lock:
                self._pauses -= 1
                self._last = self._clock()

    def allowance(self) -> float:
        if not self._stepped:
            return FIRST_STEP_ALLOWANCE * self.seconds
        return max(self.seconds, SLOW_STEP_FACTOR * self._longest_gap)

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.seconds / 4))
            with self._lock:
                silent, allowance = self._clock() - self._last, self.allowance()
                hung = not self._pauses and silent > allowance
            if hung:
                self._fire(silent, allowance)
                return

    def _fire(self, silent: float, allowance: float) -> None:
        stream = self._stream or sys.stderr
        # The exit below is what ends a hang: what goes wrong on the way to it (the description, the ledger's
        # record) is named and passed over, never left to end this thread with the process still hung.
        try:
            where = self._describe()
        except Exception as error:
            where = f" (where is unknown: {type(error).__name__}: {error})"
        rank = os.environ.get("RANK", "0")
        print(f"zaya-pretrain: error: rank {rank} made no progress for {silent:.0f} s{where} (allowed: "
              f"{allowance:.0f} s, --zaya-watchdog-seconds {self.seconds:g}): a hang; every thread's stack "
              f"follows; exiting with code {HANG_EXIT_CODE} so that torchrun --max-restarts restarts the group "
              "from the newest intact checkpoint", file=stream, flush=True)
        try:
            self._on_hang(silent, f"no progress for {silent:.0f} s (allowed: {allowance:.0f} s)")
        except Exception as error:
            print(f"zaya-pretrain: the hang was not recorded ({type(error).__name__}: {error})", file=stream)
        faulthandler.dump_traceback(file=stream, all_threads=True)
        recorded = dump_flight_recorder(self._recorder_dir) if self._recorder_dir else None
        if recorded:
            print(f"zaya-pretrain: rank {rank}'s flight recorder (its last collectives): {recorded}; all ranks': "
                  f"python -m torch.distributed.flight_recorder.fr_trace {recorded.parent}", file=stream)
        stream.flush()
        self._exit(HANG_EXIT_CODE)


WATCHDOG = ProgressWatchdog()
