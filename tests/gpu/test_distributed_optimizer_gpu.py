"""On GPUs without Transformer Engine or apex: ``zaya-pretrain --use-distributed-optimizer`` (bf16, Adam, and
Muon's ZeRO-1) saved at step 5 and resumed to step 10 reproduces the uninterrupted run.

Without the ``megatron_fixes.distopt_*`` patches every parameter shares one Adam step counter after the
resume, reset to the fresh optimizer's value: step 6 still matches and steps 7-10 drift by about 1e-2
(measured on CPU, fp32). Megatron's ``--deterministic-mode`` (deterministic torch kernels, NCCL ring, a fixed
cuBLAS workspace) makes a GPU run repeat itself bit for bit, so every resumed step must equal the
uninterrupted run exactly. One GPU is DP1; two are DP2 (the CLI relaunches itself under torchrun on every
visible GPU).

    .venv/bin/python -m pytest -q tests/gpu/test_distributed_optimizer_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from zaya_cli import QUICK, pretrain

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")

COMMON = QUICK + ["--train-iters", "10", "--use-distributed-optimizer", "--bf16", "--lr", "3e-3",
                  "--deterministic-mode"]


def _loss_csv(path: Path) -> dict[int, float]:
    rows = path.read_text().splitlines()[1:]
    return {int(i): float(v) for i, v in (row.split(",") for row in rows)}


@pytest.mark.parametrize("optimizer", ["adam", "zaya_muon"], ids=["adam", "zaya_muon-zero1"])
@pytest.mark.parametrize("gpus", [1, 2], ids=["dp1", "dp2"])
def test_distributed_optimizer_resume_matches_uninterrupted_run(gpus, optimizer, tmp_path):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(gpus)))}
    common = COMMON + ["--optimizer", optimizer]  # zaya_muon with the distributed optimizer is ZeRO-1
    full = tmp_path / "full"
    run = pretrain(common + ["--save", str(full), "--load", str(full), "--save-interval", "5"], cwd=tmp_path,
                   extra_env=env)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]

    plot = tmp_path / "resumed" / "loss.png"
    no_checkpoint = ["--save", ""]
    resumed = pretrain(common + ["--load", str(full), "--ckpt-step", "5", "--zaya-loss-plot", str(plot),
                                 *no_checkpoint], cwd=tmp_path, extra_env=env)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    expected, got = _loss_csv(full / "loss.csv"), _loss_csv(plot.with_suffix(".csv"))
    assert sorted(got) == list(range(6, 11)), got
    assert got == {i: expected[i] for i in got}, (got, expected)
