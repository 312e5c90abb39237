"""The event ledger's rules: lines appended whole by concurrent writers, a restart told from a start and what it
cost, a crash loop counted by launches, the summary line. (Through the CLI, with real faults:
tests/functional/test_watchdog_cli.py, test_reliability.py, test_checkpoint_integrity.py.)"""

from __future__ import annotations

import datetime
import json
import multiprocessing

from megatron_zaya.training.ledger import KILLED, Ledger, failing_step, launch_record, read, summary

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc).timestamp()


def _event(event, seconds, launch, step=None, rank=0, cause="", steps_lost=0, seconds_lost=0.0):
    time = datetime.datetime.fromtimestamp(T0 + seconds, datetime.timezone.utc).isoformat()
    return {"time": time, "event": event, "step": step, "rank": rank, "node": f"n{rank}", "launch": launch,
            "cause": cause, "steps_lost": steps_lost, "seconds_lost": seconds_lost}


def _append(path, rank, count):
    ledger = Ledger()
    ledger.open(path)
    for i in range(count):
        ledger.record("crash", step=i, cause=f"rank {rank} " + "x" * 2000)


def test_concurrent_writers_append_whole_lines(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    writers = [multiprocessing.get_context("spawn").Process(target=_append, args=(str(tmp_path), r, 200))
               for r in range(3)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=60)
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert len(lines) == 600 and all(json.loads(line)["event"] == "crash" for line in lines)
    with (tmp_path / "events.jsonl").open("a") as torn:  # a kill mid-write leaves a partial last line
        torn.write('{"time": "2026')
    assert len(read(tmp_path / "events.jsonl")) == 600


def test_a_launch_after_a_clean_end_is_a_start_and_after_a_failure_a_restart():
    first = [_event("start", 0, "a", step=1), _event("end", 50, "a", step=6)]
    assert launch_record(first, "b", 7, T0 + 60) == {"event": "start", "cause": "resumed at step 7", "steps_lost": 0,
                                                     "seconds_lost": 0.0}
    assert launch_record([], "a", 1, T0)["event"] == "start"
    # a hang at step 5 declared after 12 s without progress; rank 1 crashed too; the restart resumes at step 4
    hung = first[:1] + [_event("hang", 40, "a", step=5, cause="no progress for 12 s", seconds_lost=12.0),
                        _event("crash", 41, "a", step=5, rank=1, cause="RuntimeError: x")]
    record = launch_record(hung, "b", 4, T0 + 70)
    assert record == {"event": "restart", "cause": "hang on rank 0 (n0) at step 5: no progress for 12 s",
                      "steps_lost": 1, "seconds_lost": 42.0}  # from the last progress (40 - 12) to the first step
    killed = launch_record(first[:1], "b", 4, T0 + 70)  # SIGKILL: nothing recorded
    assert killed == {"event": "restart", "cause": KILLED, "steps_lost": None, "seconds_lost": None}


def test_a_crash_loop_counts_launches_not_ranks_and_restarts_the_count():
    two_ranks = [_event("crash", 1, "a", step=7), _event("crash", 1, "a", step=8, rank=1)]
    assert failing_step(two_ranks, 2) is None  # one launch, two lines: its first failure counts
    loop = two_ranks + [_event("hang", 9, "b", step=7, rank=1, cause="stuck")]
    assert failing_step(loop, 2)["cause"] == "stuck" and failing_step(loop, 3) is None
    assert failing_step(loop, 0) is None  # 0: never stop
    moved = loop + [_event("crash", 20, "c", step=9)]
    assert failing_step(moved, 2) is None
    skipped = loop + [_event("skipped_step", 30, "c", step=7)]
    assert failing_step(skipped, 2) is None


def test_the_summary_counts_events_and_what_they_cost():
    # Launch b resumes from 2 past a damaged 4 after a hang at 5: its restart counts steps 2-4 (the skip's 2
    # among them). Launch d, after a clean end, finds a damaged checkpoint: that skip counts on its own.
    events = [_event("start", 0, "a", step=1), _event("hang", 40, "a", step=5, seconds_lost=12.0),
              _event("checkpoint_skipped", 69, "b", step=2, steps_lost=2),
              _event("restart", 70, "b", step=3, steps_lost=3, seconds_lost=42.0),
              _event("restart", 90, "c", step=3, steps_lost=None, seconds_lost=None), _event("end", 95, "c", step=8),
              _event("checkpoint_skipped", 99, "d", step=6, steps_lost=2), _event("start", 100, "d", step=7)]
    assert summary(events, "ck/events.jsonl") == (
        "[zaya] event ledger ck/events.jsonl: launches 4, restarts 2, hangs 1, crashes 0, skipped steps 0, "
        "damaged checkpoints skipped 2, nodes excluded 0; lost to faults: steps 5, seconds 42, and restarts of "
        "unknown cost 1")
