import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Megatron compiles its fused bias-activation and bias-dropout-add functions (torch.compile) on their first
# call in every process: 1-4 s per CLI run or gloo rank, more than most tests' training steps take. The tests
# (and the subprocesses they start, which inherit this) run them uncompiled; each test's reference runs the
# same way, and zaya-pretrain then imports no dynamo either (the startup.compile_disabled patch). `make train`
# and real runs keep compiling.
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
# One compute thread per process (set before torch is imported; inherited by the CLI runs and gloo ranks):
# `make test` already keeps every core busy with one test per core, and a second OpenMP thread per process
# only spins at the barriers of the tiny models' ops. Measured on 2 loaded cores: a 6-step CLI run of the
# tiny preset used 41 s of CPU with two threads, 21-23 s with one.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from shared import once  # noqa: E402
from zaya_cli import KILLED_RUN, MUON_RUN, loss_csv, pretrain  # noqa: E402


@pytest.fixture
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    """Steps 1-12 of a ``KILLED_RUN`` that nothing interrupts: its loss curve at full precision, what a run
    killed and resumed (persistent or local checkpoints, synchronous or background saves) must repeat."""

    def train(directory):
        flags = ["--save-interval", "3", "--save", "ck", "--load", "ck", "--exit-interval", "12"]
        run = pretrain(KILLED_RUN + flags, cwd=directory)
        assert run.returncode == 0, run.stderr[-3000:]

    curve = loss_csv(once(tmp_path_factory, "uninterrupted", train) / "ck" / "loss.csv")
    assert sorted(curve) == list(range(1, 13))
    return curve


@pytest.fixture
def muon_run(tmp_path_factory) -> Path:
    """A ``MUON_RUN`` that nothing interrupts, in ``<dir>/full`` (checkpoints, ``loss.csv``, ``loss.png``),
    its output in ``<dir>/stdout.log``: the reference of exact resumes and of data-parallel runs. It logs the
    weights' norm (``--log-params-norm``), which changes nothing it trains."""

    def train(directory):
        run = pretrain(MUON_RUN + ["--save", "full", "--load", "full", "--log-params-norm"], cwd=directory)
        assert run.returncode == 0, run.stderr[-3000:]
        (directory / "stdout.log").write_text(run.stdout)

    return once(tmp_path_factory, "muon-run", train)


@pytest.fixture(scope="session")
def model_kernels():
    """The model's Triton kernel modules, loaded once, interpreted (``triton_interpreter.load_model_kernels``)."""
    from triton_interpreter import load_model_kernels

    return load_model_kernels()
