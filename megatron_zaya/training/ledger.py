"""The run's event ledger, ``<save>/events.jsonl``: one JSON line per start, restart, hang, crash, skipped step,
damaged checkpoint skipped, node excluded and end, for every launch that trains into the same ``--save``.

Each line is written by the process that saw the event, in one ``write`` to a file opened with ``O_APPEND``, so
lines of several ranks never interleave (on one host, and on NFS and Lustre for lines this short):

* ``start`` / ``restart``: global rank 0 at the first step of a launch. A launch is a restart when the launch
  before it in the ledger recorded a failure or no ``end`` (it was killed); the line names the first failure
  and what the restart cost, from the previous launch's last progress to this first step.
* ``hang``: the rank whose progress watchdog fired, before it exits (``watchdog.py``).
* ``crash``: each rank that an exception or a fault stopped (``training/command.py``).
* ``checkpoint_skipped``: rank 0, when a resume passes over a damaged checkpoint (``checkpoint/integrity.py``).
* ``node_excluded``: the rank whose node failed its self-test (``health.py``); the Slurm scripts requeue the
  job without it.
* ``skipped_step``: rank 0, when ``--zaya-skip-failing-steps`` skips the batch of a step that failed
  ``--zaya-max-step-failures`` times.
* ``end``: rank 0, when a launch stops cleanly (its last step, ``--exit-interval``, a saved pre-emption).

Fields: ``time`` (UTC, ISO 8601), ``event``, ``step`` (the iteration, 1-based; null before training), ``rank``,
``node`` (Slurm's node name, else the host name), ``launch`` (shared by the ranks of one launch), ``cause`` (the
last error line), ``steps_lost`` and ``seconds_lost`` (null when unknown). What each costs: docs/reliability.md.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from pathlib import Path

LEDGER_FILE = "events.jsonl"
CRASH_LOOP_EXIT_CODE = 5
FAILURES = ("hang", "crash", "node_excluded")  # events that end a launch
KILLED = "the launch ended without a record (killed: SIGKILL, out of memory, or a node lost)"


def launch_id() -> str:
    """What the ranks of one launch share and no other launch has: the Slurm job and its requeue, torchrun's run
    and its restart; a process without a launcher: its host and PID."""
    env = os.environ
    parts = []
    if "SLURM_JOB_ID" in env:
        parts.append(f"slurm-{env['SLURM_JOB_ID']}.{env.get('SLURM_RESTART_COUNT', '0')}")
    if "TORCHELASTIC_RESTART_COUNT" in env:
        parts.append(f"torchrun-{env.get('TORCHELASTIC_RUN_ID', '')}.{env['TORCHELASTIC_RESTART_COUNT']}")
    return "/".join(parts) or f"{socket.gethostname()}-{os.getpid()}"


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def node_name() -> str:
    """The scheduler's name for this node (what ``scontrol`` takes), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _now() -> float:
    return datetime.datetime.now(datetime.timezone.utc).timestamp()


def _seconds(event: dict) -> float:
    return datetime.datetime.fromisoformat(event["time"]).timestamp()


def read(path: str | os.PathLike) -> list[dict]:
    """The events of a ledger file, oldest first; a line torn by a kill mid-write is left out."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return []
    events = []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "event" in event and "time" in event:
            events.append(event)
    return events


def _launches(events: list[dict]) -> list[tuple[str, list[dict]]]:
    """The events grouped by launch, in the order each launch first appears."""
    grouped: dict[str, list[dict]] = {}
    for event in events:
        grouped.setdefault(event.get("launch", ""), []).append(event)
    return list(grouped.items())


def launch_record(events: list[dict], launch: str, first_step: int, now: float) -> dict:
    """The ``start`` or ``restart`` line of ``launch`` at its first step, from the ledger's earlier launches."""
    earlier = [(name, group) for name, group in _launches(events) if name != launch]
    if not earlier:
        return {"event": "start", "cause": "", "steps_lost": 0, "seconds_lost": 0.0}
    previous = earlier[-1][1]
    failures = [e for e in previous if e["event"] in FAILURES]
    if not failures and any(e["event"] == "end" for e in previous):
        return {"event": "start", "cause": f"resumed at step {first_step}", "steps_lost": 0, "seconds_lost": 0.0}
    if not failures:
        return {"event": "restart", "cause": KILLED, "steps_lost": None, "seconds_lost": None}
    first = failures[0]
    where = f" at step {first['step']}" if first.get("step") is not None else ""
    cause = f"{first['event']} on rank {first['rank']} ({first['node']}){where}: {first['cause']}"
    # The previous launch's last progress: a hang had made none for its seconds_lost before it was declared.
    stalled = min(_seconds(e) - (e.get("seconds_lost") or 0.0) for e in failures)
    reached = max((e["step"] for e in failures if e.get("step") is not None), default=first_step)
    return {"event": "restart", "cause": cause, "steps_lost": max(0, reached - first_step),
            "seconds_lost": round(now - stalled, 1)}


def failing_step(events: list[dict], limit: int) -> dict | None:
    """The first failure of the last launch, when the launches before it failed first at its step too, ``limit``
    launches in a row (a crash loop); else None.

    A launch counts by its first failure (``hang`` or ``crash`` in training), whichever of its ranks recorded it and
    whatever its other ranks recorded after; a ``skipped_step`` ends the row."""
    firsts, seen = [], set()
    for event in events:
        if event["event"] == "skipped_step":
            firsts.append(event)
        elif event["event"] in ("hang", "crash") and event.get("step") is not None and event.get("launch") not in seen:
            seen.add(event.get("launch"))
            firsts.append(event)
    if not limit or not firsts or firsts[-1]["event"] == "skipped_step":
        return None
    last, count = firsts[-1], 0
    for event in reversed(firsts):
        if event["event"] == "skipped_step" or event["step"] != last["step"]:
            break
        count += 1
    return last if count >= limit else None


def summary(events: list[dict], path: str | os.PathLike) -> str:
    """One line: how many launches and events the ledger holds, and the steps and seconds the faults cost."""
    counts: dict[str, int] = {}
    for event in events:
        counts[event["event"]] = counts.get(event["event"], 0) + 1
    launches = counts.get("start", 0) + counts.get("restart", 0)
    named = [("restart", "restarts"), ("hang", "hangs"), ("crash", "crashes"), ("skipped_step", "skipped steps"),
             ("checkpoint_skipped", "damaged checkpoints skipped"), ("node_excluded", "nodes excluded")]
    parts = [f"launches {launches}"] + [f"{label} {counts.get(kind, 0)}" for kind, label in named]
    # A restart's steps_lost already counts the steps back to the checkpoint it loaded, past any damaged ones.
    restarted = {e.get("launch") for e in events if e["event"] == "restart"}
    costs = [e for e in events if e["event"] in ("restart", "skipped_step")
             or (e["event"] == "checkpoint_skipped" and e.get("launch") not in restarted)]
    steps = sum(e.get("steps_lost") or 0 for e in costs)
    seconds = sum(e.get("seconds_lost") or 0.0 for e in costs)
    unknown = sum(e.get("seconds_lost") is None for e in costs)
    more = f", and restarts of unknown cost {unknown}" if unknown else ""
    return f"[zaya] event ledger {path}: {', '.join(parts)}; lost to faults: steps {steps}, seconds {seconds:.0f}{more}"


class Ledger:
    """The ledger of this process's run (:data:`LEDGER`): off until :meth:`open` gives it a ``--save``
    directory."""

    def __init__(self):
        self.path: Path | None = None
        self.launch = launch_id()
        self._started = False

    def open(self, save_dir: str | None) -> None:
        self.path = Path(save_dir) / LEDGER_FILE if save_dir else None

    def events(self) -> list[dict]:
        return read(self.path) if self.path else []

    def record(self, event: str, step: int | None = None, cause: str = "", steps_lost: int | None = 0,
               seconds_lost: float | None = 0.0) -> None:
        """Append one line (one ``write`` with ``O_APPEND``); a ledger that cannot be written costs a warning, not
        the run."""
        if self.path is None:
            return
        stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
        line = json.dumps({"time": stamp, "event": event, "step": step, "rank": _rank(),
                           "node": node_name(), "launch": self.launch, "cause": cause,
                           "steps_lost": steps_lost, "seconds_lost": seconds_lost}) + "\n"
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError as error:
            print(f"zaya-pretrain: warning: the event ledger {self.path} cannot be written ({error})", flush=True)

    def failure(self, event: str, step: int | None, cause: str, saved: str | None, seconds: float = 0.0) -> None:
        """A ``hang`` or ``crash`` at ``step``: the steps since the last checkpoint (``saved``, the tracker's
        marker) are lost, and for a hang the ``seconds`` without progress before it was declared."""
        lost = max(0, step - 1 - int(saved)) if step is not None and saved and saved.isdigit() else None
        self.record(event, step, cause, steps_lost=lost, seconds_lost=round(seconds, 1))

    def checkpoint_skipped(self, damaged: list[str], newest: str, loaded: str) -> None:
        """A resume passed over the ``damaged`` checkpoints (one finding each), the ``newest`` of them first, for
        ``loaded``: the steps between the two are trained again."""
        lost = int(newest) - int(loaded) if newest.isdigit() and loaded.isdigit() else None
        self.record("checkpoint_skipped", int(loaded) if loaded.isdigit() else None, "; ".join(damaged),
                    steps_lost=lost)

    def first_step(self, step: int) -> None:
        """At the first training step of this launch, on global rank 0: its ``start`` or ``restart`` line."""
        if self._started or _rank() != 0:
            return
        self._started = True
        if self.path is not None:
            line = launch_record(self.events(), self.launch, step, _now())
            self.record(line.pop("event"), step, **line)


def last_error_line(error: BaseException) -> str:
    """The line a traceback ends with: the exception's type and the first line of its message."""
    message = str(error).strip().splitlines()
    return f"{type(error).__name__}: {message[0]}" if message else type(error).__name__


LEDGER = Ledger()
