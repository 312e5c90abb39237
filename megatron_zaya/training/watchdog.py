"""The progress watchdog of ``--zaya-watchdog-seconds T``: a rank whose training stops making progress writes every
thread's stack to its log and exits with :data:`HANG_EXIT_CODE`, so that torchrun's elastic agent
(``--max-restarts``) restarts the group from the newest intact checkpoint, instead of every rank waiting for the
collective timeout (10 minutes by default) and then ending the job.

Progress is a beat: each micro-batch's forward (training and evaluation) and each optimizer step
(:class:`~megatron_zaya.training.reliability.StepGuard` gives them). A rank hangs when no beat came for longer
than its allowance:

* until the first optimizer step, ``FIRST_STEP_ALLOWANCE * T`` (data loaders, kernel compilation, graph capture);
* then ``T``, or ``SLOW_STEP_FACTOR`` times the longest gap between beats measured so far (the first step's,
  compilation included) when that is longer: a run whose steps are merely slow is not a hang;
* never while a checkpoint is being saved (:meth:`ProgressWatchdog.paused`).

Off by default (``T = 0``). How to choose T: docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time

HANG_EXIT_CODE = 4
FIRST_STEP_ALLOWANCE = 10
SLOW_STEP_FACTOR = 4


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

    def arm(self, seconds: float, describe=lambda: "", on_hang=lambda silent, cause: None) -> None:
        """Watch from now on; ``describe()`` names where the run is (e.g. the iteration) in the hang's line, and
        ``on_hang(seconds without progress, cause)`` records a hang before the exit."""
        if seconds <= 0 or self.seconds > 0:
            return
        self.seconds, self._describe, self._on_hang, self._last = seconds, describe, on_hang, self._clock()
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
        """No hang is declared inside (a checkpoint save); the gap restarts at its end."""
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
        where = self._describe()
        rank = os.environ.get("RANK", "0")
        print(f"zaya-pretrain: error: rank {rank} made no progress for {silent:.0f} s{where} (allowed: "
              f"{allowance:.0f} s, --zaya-watchdog-seconds {self.seconds:g}): a hang; every thread's stack "
              f"follows; exiting with code {HANG_EXIT_CODE} so that torchrun --max-restarts restarts the group "
              "from the newest intact checkpoint", file=stream, flush=True)
        self._on_hang(silent, f"no progress for {silent:.0f} s (allowed: {allowance:.0f} s)")
        faulthandler.dump_traceback(file=stream, all_threads=True)
        stream.flush()
        self._exit(HANG_EXIT_CODE)


WATCHDOG = ProgressWatchdog()
