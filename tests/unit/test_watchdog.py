"""The progress watchdog's rules on a real thread and a real clock, with short allowances; its exit is recorded
instead of taken. (Through the CLI, with a real hang and torchrun's restart: tests/functional/test_watchdog_cli.py.)"""

from __future__ import annotations

import argparse
import threading
import time

import pytest

from megatron_zaya.training.watchdog import FIRST_STEP_ALLOWANCE, HANG_EXIT_CODE, SLOW_STEP_FACTOR, ProgressWatchdog

T = 0.1


@pytest.fixture
def watchdog(tmp_path):
    fired = threading.Event()
    codes = []
    log = (tmp_path / "rank.log").open("w+")

    def record_exit(code):
        codes.append(code)
        fired.set()

    dog = ProgressWatchdog(exit=record_exit, stream=log)
    dog.fired, dog.codes, dog.log = fired, codes, log
    yield dog
    log.close()


def _beat_for(dog, seconds, every, step_done=True):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        dog.beat(step_done=step_done)
        time.sleep(every)


def test_a_silent_rank_is_declared_hung_after_the_first_step_allowance(watchdog):
    start = time.monotonic()
    watchdog.arm(T, describe=lambda: " in iteration 7")
    assert watchdog.fired.wait(timeout=30)
    waited = time.monotonic() - start
    assert FIRST_STEP_ALLOWANCE * T < waited < FIRST_STEP_ALLOWANCE * T + 2, waited
    assert watchdog.codes == [HANG_EXIT_CODE]
    watchdog.log.seek(0)
    text = watchdog.log.read()
    first = text.splitlines()[0]
    assert first.startswith("zaya-pretrain: error: rank 0 made no progress for ") and " in iteration 7 " in first
    assert "torchrun --max-restarts" in first
    # every thread's stack: this test's own frame among them
    assert "test_a_silent_rank_is_declared_hung_after_the_first_step_allowance" in text


def test_steady_beats_and_a_save_are_no_hang_but_silence_after_them_is(watchdog):
    watchdog.arm(T)
    _beat_for(watchdog, 1.0, T / 4)
    with watchdog.paused():  # a save 10x the allowance
        time.sleep(10 * T)
    assert not watchdog.fired.is_set()
    start = time.monotonic()
    assert watchdog.fired.wait(timeout=30)
    assert time.monotonic() - start < 1 + SLOW_STEP_FACTOR * T, "declared long after the allowance"


def test_slow_steps_raise_the_allowance(watchdog):
    watchdog.arm(T)
    watchdog.beat()  # the first step's forward, then its optimizer step 3x T later
    time.sleep(3 * T)
    _beat_for(watchdog, 1.2, 3 * T)  # steps 3x T long: the allowance becomes 4 x 3T
    assert not watchdog.fired.is_set()
    assert watchdog.allowance() >= SLOW_STEP_FACTOR * 3 * T
    assert watchdog.fired.wait(timeout=30)


def test_off_by_default():
    def watchdogs():
        return sum(t.name == "zaya-watchdog" for t in threading.enumerate())

    before = watchdogs()
    dog = ProgressWatchdog(exit=lambda code: pytest.fail("fired"))
    dog.arm(0.0)
    assert watchdogs() == before and dog.seconds == 0


def test_a_hang_is_exited_even_where_its_description_and_record_fail(watchdog):
    """Before the training loop Megatron's arguments have no ``curr_iteration``: reading it raised AttributeError in
    the watchdog's thread, which ended there, and the hung rank never exited. Now the line says so and it exits."""

    def no_iteration_yet():
        return argparse.Namespace().curr_iteration

    def unrecorded(silent, cause):
        raise OSError(28, "No space left on device")

    watchdog.arm(T, describe=no_iteration_yet, on_hang=unrecorded)
    assert watchdog.fired.wait(timeout=30)
    assert watchdog.codes == [HANG_EXIT_CODE]
    watchdog.log.seek(0)
    lines = watchdog.log.read().splitlines()
    assert lines[0].startswith("zaya-pretrain: error: rank 0 made no progress for ")
    assert " (where is unknown: AttributeError: 'Namespace' object has no attribute 'curr_iteration') " in lines[0]
    assert lines[1] == "zaya-pretrain: the hang was not recorded (OSError: [Errno 28] No space left on device)"
