"""Shared by the fake Slurm/launcher commands in this folder: append one JSON record per call.

Each record is a file $FAKE_SLURM_RECORDS/<ns>-<tool>-<pid>.json holding the tool name, its argv, its
environment and working directory and the time, so a test can assert exactly what each node ran.
"""

import json
import os
import sys
import time


def record(tool: str, **extra) -> None:
    stamp = time.time_ns()
    entry = {"tool": tool, "argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd(), "time": stamp}
    entry.update(extra)
    path = os.path.join(os.environ["FAKE_SLURM_RECORDS"], f"{stamp}-{tool}-{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(entry, f)
    os.replace(path + ".tmp", path)  # readers never see a half-written record


def split_options(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """Split `--name=value` / `--flag` options from the command that follows them."""
    options = {}
    while args and args[0].startswith("-"):
        name, _, value = args.pop(0).lstrip("-").partition("=")
        options[name] = value
    return options, args
