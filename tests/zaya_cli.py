"""Run ``zaya-pretrain`` in a subprocess and read back what a user would see."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")

# Small and quick: the tiny preset on the embedded corpus, short sequences.
QUICK = ["--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "8", "--lr-warmup-iters", "2",
         "--eval-iters", "0", "--log-interval", "1"]


FAULT_HOOKS = Path(__file__).parent / "fault_hooks"


def with_faults(spec: str) -> dict[str, str]:
    """Environment for a subprocess that injects the faults ``spec`` (see fault_hooks/sitecustomize.py)."""
    path = os.pathsep.join(p for p in (str(FAULT_HOOKS), os.environ.get("PYTHONPATH")) if p)
    return {"ZAYA_FAULT_INJECT": spec, "PYTHONPATH": path}


def pretrain(args: list[str], cwd: Path, timeout: int = 600, extra_env: dict | None = None, nproc: int = 1):
    """``zaya-pretrain ARGS`` in a subprocess; with ``nproc`` > 1 under torchrun (gloo on CPU)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    env.pop("WORLD_SIZE", None)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc > 1 else []
    return subprocess.run([sys.executable, *launcher, "-m", "megatron_zaya.pretrain", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def losses(stdout: str) -> dict[int, float]:
    """``{iteration: lm loss}`` from Megatron's iteration lines."""
    return {int(m.group(1)): float(m.group(2)) for m in ITERATION.finditer(stdout)}
