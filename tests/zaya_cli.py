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
# The runs that the fault tests kill and resume: long enough never to end on their own.
KILLED_RUN = QUICK + ["--train-iters", "400"]
# A zaya_muon run of 20 steps, checkpoints at 10 and 20 (the loss falls by more than a nat).
MUON_RUN = QUICK + ["--train-iters", "20", "--save-interval", "10", "--optimizer", "zaya_muon", "--lr", "0.02"]


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


def loss_csv(path: Path) -> dict[int, float]:
    """``{iteration: loss}`` from the loss curve's CSV (``<--save>/loss.csv``): full precision, every step."""
    rows = Path(path).read_text().splitlines()[1:]
    return {int(i): float(v) for i, v in (row.split(",") for row in rows)}


def checkpoint_state(step_dir: Path, scratch: Path) -> dict[str, object]:
    """Everything a ``torch_dist`` checkpoint step holds, flattened to ``{"key/sub/0": leaf}``: weights, optimizer
    moments and step counts, the LR scheduler, the iteration, the RNG states. The launch's own arguments
    (``args``: its paths, ``--exit-interval``) are left out."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / f"{step_dir.parent.name}-{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, out)
    flat: dict[str, object] = {}

    def walk(key, value):
        if isinstance(value, dict):
            for k, v in value.items():
                if k != "args":
                    walk(f"{key}/{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{key}/{i}", v)
        else:
            flat[key] = value

    for key, value in torch.load(out, weights_only=False).items():
        walk(key, value)
    return flat


def same_leaf(a, b) -> bool:
    """Bit-for-bit equality of two checkpoint leaves (tensors and arrays: dtype, shape and every element)."""
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return type(a) is type(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return type(a) is type(b) and a.dtype == b.dtype and np.array_equal(a, b)
    return type(a) is type(b) and a == b


def differing(expected: dict[str, object], got: dict[str, object]) -> list[str]:
    """The keys of two ``checkpoint_state``s that differ (or that only one holds)."""
    keys = sorted(set(expected) | set(got))
    return [k for k in keys if k not in expected or k not in got or not same_leaf(expected[k], got[k])]


def assert_resumed_exactly(curve: dict[int, float], steps: range, killed: dict[int, float],
                           resumed: dict[int, float], uninterrupted: dict[int, float]) -> None:
    """A launch resumed after a fault repeated the run it resumes: its logged losses equal the killed launch's
    at every step both logged, and its loss curve (``loss_csv``) holds ``steps`` and equals the uninterrupted
    run's curve at every point, bit for bit."""
    both = range(min(resumed), min(max(killed), max(resumed)) + 1)
    assert [resumed[i] for i in both] == [killed[i] for i in both], (resumed, killed)
    assert set(steps) <= set(curve) <= set(uninterrupted), (sorted(curve), steps)
    assert all(curve[i] == uninterrupted[i] for i in curve), (curve, uninterrupted)
