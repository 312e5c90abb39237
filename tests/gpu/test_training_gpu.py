"""On GPUs, through the CLI in bf16 under ``--deterministic-mode`` (GPU runs repeat bit for bit): exact resume with
Megatron's distributed optimizer, Adam and Muon's ZeRO-1; a background save, written while training went on,
resumed exactly; a run SIGKILLed, resumed exactly from the in-memory tier; a NaN on one rank skipped on every
rank; the fused weight gradients against the unfused ones; the MoE sublayer and the CCA sublayer's part before its
attention, each as one op, against their kernels op by op (within bf16 rounding).

Two uninterrupted runs (one per optimizer, module fixtures) serve every test of their optimizer: each is a
reference that a test repeats from its checkpoint of step 5. Up to two GPUs (data parallel; the CLI relaunches
itself under torchrun on every visible GPU).

Without the ``megatron_fixes.distopt_*`` patches every parameter shares one Adam step counter after the resume,
reset to the fresh optimizer's value: step 6 still matches and steps 7-10 drift by about 1e-2.

    python -m pytest -q tests/gpu/test_training_gpu.py
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from zaya_cli import QUICK, losses, pretrain, with_faults

from megatron_zaya.checkpoint import CHECKSUMS
from megatron_zaya.config import KERNEL_OPS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")

GPUS = min(torch.cuda.device_count(), 2) if torch.cuda.is_available() else 0
ENV = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(GPUS)))}
COMMON = QUICK + ["--train-iters", "10", "--bf16", "--use-distributed-optimizer", "--deterministic-mode",
                  "--lr", "3e-3"]
OPTIMIZER = {"adam": ["--optimizer", "adam"], "zaya_muon": ["--optimizer", "zaya_muon", "--lr", "0.02"]}
NAN_STEP = 3  # the uninterrupted Muon run's injected NaN gradient, on the last rank only


def _loss_csv(path: Path) -> dict[int, float]:
    rows = path.read_text().splitlines()[1:]
    return {int(i): float(v) for i, v in (row.split(",") for row in rows)}


def _uninterrupted(optimizer: str, root: Path, flags: list[str], env: dict) -> tuple[Path, str]:
    run_dir = root / optimizer
    run = pretrain(COMMON + OPTIMIZER[optimizer] + ["--save", str(run_dir), "--load", str(run_dir),
                                                    "--save-interval", "5", *flags],
                   cwd=root, extra_env={**ENV, **env})  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    return run_dir, run.stdout + run.stderr


@pytest.fixture(scope="module")
def muon_run(tmp_path_factory):
    """ZeRO-1 Muon with background saves (staged through the host pool while training goes on), a NaN
    gradient on one rank at step 3 and the replica check every 5 steps: (checkpoint dir, console output)."""
    flags = ["--async-save", "--zaya-replica-check-interval", "5"]
    faults = with_faults(f"nan_grad@{NAN_STEP}@{GPUS - 1}")
    return _uninterrupted("zaya_muon", tmp_path_factory.mktemp("muon"), flags, faults)


@pytest.fixture(scope="module")
def adam_run(tmp_path_factory):
    """Megatron's sharded Adam with synchronous saves, the weight gradients fused into main_grad (the default)."""
    return _uninterrupted("adam", tmp_path_factory.mktemp("adam"), [], {})


def _resumed_from_step_5(optimizer: str, run_dir: Path, tmp_path: Path) -> dict[int, float]:
    plot = tmp_path / "resumed" / "loss.png"
    resumed = pretrain(COMMON + OPTIMIZER[optimizer] + ["--load", str(run_dir), "--ckpt-step", "5", "--save", "",
                                                        "--zaya-loss-plot", str(plot)],
                       cwd=tmp_path, extra_env=ENV)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    return _loss_csv(plot.with_suffix(".csv"))


@pytest.mark.xdist_group("zaya_muon")
def test_zero1_muon_resumes_exactly_from_a_background_save(muon_run, tmp_path):
    run_dir, _ = muon_run
    expected, got = _loss_csv(run_dir / "loss.csv"), _resumed_from_step_5("zaya_muon", run_dir, tmp_path)
    assert sorted(expected) == list(range(1, 11)) and sorted(got) == list(range(6, 11)), (expected, got)
    assert got == {i: expected[i] for i in got}


@pytest.mark.xdist_group("zaya_muon")
def test_zero1_muon_killed_resumes_exactly_from_the_in_memory_tier(muon_run, tmp_path):
    """The Muon run with in-memory checkpoints every 3 steps as well, SIGKILLed (every process of it) after step 7
    once every rank's part of step 6 is complete: relaunched, it resumes from the in-memory tier's step 6, newer
    than the persistent checkpoint of step 5, and repeats the uninterrupted run's losses 7-10 bit for bit."""
    run_dir, _ = muon_run
    flags = COMMON + OPTIMIZER["zaya_muon"] + ["--save", "ck", "--load", "ck", "--save-interval", "5", "--async-save",
                                              "--zaya-replica-check-interval", "5", "--zaya-memory-ckpt-interval",
                                              "3", "--zaya-memory-ckpt-dir", "mem"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **ENV, **with_faults(f"nan_grad@{NAN_STEP}@{GPUS - 1}")}
    parts = [tmp_path / "mem" / "iter_0000006" / f"rank_{r:05d}" / CHECKSUMS for r in range(GPUS)]
    with (tmp_path / "killed.log").open("w") as log:
        killed = subprocess.Popen([sys.executable, "-m", "megatron_zaya.pretrain", *flags], cwd=tmp_path, env=env,
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300
    while (max(losses((tmp_path / "killed.log").read_text()), default=0) < 7 or not all(p.exists() for p in parts)) \
            and killed.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    out = (tmp_path / "killed.log").read_text()
    assert all(p.exists() for p in parts) and 7 <= max(losses(out)) < 10, out[-4000:]

    resumed = pretrain(flags, cwd=tmp_path, extra_env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "[zaya] local checkpoint found and read in" in resumed.stdout + resumed.stderr, resumed.stdout[-4000:]
    expected, got = _loss_csv(run_dir / "loss.csv"), _loss_csv(tmp_path / "ck" / "loss.csv")
    assert {i: got[i] for i in range(7, 11)} == {i: expected[i] for i in range(7, 11)}, (expected, got)


@pytest.mark.xdist_group("zaya_muon")
def test_nan_on_one_rank_is_skipped_everywhere(muon_run):
    _, out = muon_run
    assert re.findall(r"iteration\s+(\d+) \| non-finite step skipped", out) == [str(NAN_STEP)], out[-4000:]
    # the replicas are checked at every data-parallel size (one replica: its own parameters against themselves)
    assert re.findall(r"iteration\s+(\d+) \| data-parallel replicas identical", out) == ["5", "10"], out[-4000:]
    assert all(torch.isfinite(torch.tensor(v)) for v in losses(out).values())


@pytest.mark.xdist_group("adam")
def test_distributed_adam_resumes_exactly(adam_run, tmp_path):
    run_dir, _ = adam_run
    expected, got = _loss_csv(run_dir / "loss.csv"), _resumed_from_step_5("adam", run_dir, tmp_path)
    assert sorted(expected) == list(range(1, 11)) and sorted(got) == list(range(6, 11)), (expected, got)
    assert got == {i: expected[i] for i in got}


def _agree_within_bf16_noise(got: dict[int, float], want: dict[int, float]) -> None:
    """Every step's loss of ``got`` within 2e-3 of ``want``'s, relatively: two runs whose gradients differ by bf16
    roundings."""
    for step, expected in want.items():
        assert abs(got[step] - expected) <= 2e-3 * abs(expected), (step, got, want)


@pytest.mark.xdist_group("adam")
def test_fused_weight_gradients_train_like_unfused(adam_run, tmp_path):
    """Megatron's gradient-accumulation fusion on the ``kernels.weight_gradient_accumulation`` stand-in (CCA's
    projections add their weight gradients straight into the fp32 ``main_grad``) against
    ``--no-gradient-accumulation-fusion`` (bf16 weight gradients that DDP's hooks add)."""
    run_dir, _ = adam_run
    fused = _loss_csv(run_dir / "loss.csv")
    run = pretrain(COMMON + OPTIMIZER["adam"] + ["--save", "", "--no-gradient-accumulation-fusion"], cwd=tmp_path,
                   extra_env=ENV)
    assert run.returncode == 0, run.stderr[-4000:]
    unfused = losses(run.stdout)
    assert sorted(unfused) == sorted(fused) == list(range(1, 11)), (unfused, fused)
    # The fused run skips the bf16 rounding of each weight gradient: the losses agree to bf16 training noise.
    _agree_within_bf16_noise(fused, unfused)
    assert any(abs(fused[s] - unfused[s]) > 1e-6 * abs(unfused[s]) for s in unfused), "the fusion did not run"


def _trains_like_op_by_op(adam_run, tmp_path, op: str) -> None:
    """``op`` (on in eager runs under ``--zaya-kernels all``, as in ``adam_run``) against its kernels run op by op,
    every other kernel op as ``all`` takes it: the first step's loss bit for bit (the same forward), the later ones
    within bf16 rounding (the op adds the input's gradients by its GEMMs, which round the sums once; autograd adds
    them after, in bf16)."""
    run_dir, _ = adam_run
    with_op = _loss_csv(run_dir / "loss.csv")
    plot = tmp_path / "op-by-op" / "loss.png"
    kernels = ",".join(name for name in KERNEL_OPS if name != op)
    run = pretrain(COMMON + OPTIMIZER["adam"] + ["--save", "", "--zaya-loss-plot", str(plot), "--zaya-kernels",
                                                 kernels], cwd=tmp_path, extra_env=ENV)
    assert run.returncode == 0, run.stderr[-4000:]
    op_by_op = _loss_csv(plot.with_suffix(".csv"))
    first = min(op_by_op)
    assert op_by_op.keys() == with_op.keys() and op_by_op[first] == with_op[first], (op_by_op, with_op)
    _agree_within_bf16_noise(with_op, op_by_op)


@pytest.mark.xdist_group("adam")
def test_moe_op_trains_like_its_kernels_op_by_op(adam_run, tmp_path):
    """The ``moe`` op: the same kernels in the same order, the router projection's gradient of the input added by its
    GEMM."""
    _trains_like_op_by_op(adam_run, tmp_path, "moe")


@pytest.mark.xdist_group("adam")
def test_cca_sublayer_op_trains_like_its_kernels_op_by_op(adam_run, tmp_path):
    """The ``cca_sublayer`` op: the same kernels, and the projections' GEMMs as Megatron's linear layers run them
    (their weight gradients added into the fp32 ``main_grad`` by the ``kernels.weight_gradient_accumulation``
    stand-in's GEMM, which the op calls too), their gradients of the input added up by the GEMMs."""
    _trains_like_op_by_op(adam_run, tmp_path, "cca_sublayer")
