"""Work done once per test session and shared by its tests, across pytest-xdist workers.

A session- or module-scoped fixture runs once per worker: under ``make test``'s work stealing, two tests that
share a trained checkpoint often land on different workers, and each would train it. ``once`` builds a
directory the first time any worker asks for it (the others wait on a file lock) and hands every later caller
the same directory, which they must treat as read-only (copy it to change it).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock


def once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """The directory ``name``, filled by ``build(directory)`` once per session (all workers)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker has its own base under the session's
        root = root.parent
    directory, done = root / "shared" / name, root / "shared" / f"{name}.done"
    directory.parent.mkdir(exist_ok=True)
    with FileLock(str(directory.parent / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(directory, ignore_errors=True)  # left by a build that failed in another test
            directory.mkdir()
            build(directory)
            done.touch()
    return directory
