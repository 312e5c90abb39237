"""On a GPU, through the CLI: Megatron's gradient-accumulation fusion on the ``kernels.weight_gradient_accumulation``
stand-in (CCA's projections add their weight gradients straight into the fp32 ``main_grad``) trains as the
unfused run does (``--no-gradient-accumulation-fusion``: bf16 weight gradients that DDP's hooks add).

    .venv/bin/python -m pytest -q tests/gpu/test_weight_gradient_fusion_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from zaya_cli import QUICK, losses, pretrain

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")


def test_fused_weight_gradients_train_like_unfused(tmp_path):
    common = QUICK + ["--train-iters", "6", "--bf16", "--lr", "3e-3", "--deterministic-mode", "--save", ""]
    runs = {}
    for name, flags in (("fused", []), ("unfused", ["--no-gradient-accumulation-fusion"])):
        run = pretrain(common + flags, cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        runs[name] = losses(run.stdout)
    assert sorted(runs["fused"]) == list(range(1, 7)), runs
    # The fused run skips the bf16 rounding of each weight gradient: the losses agree to bf16 training noise.
    for step, want in runs["unfused"].items():
        assert abs(runs["fused"][step] - want) <= 2e-3 * abs(want), (step, runs)
    assert runs["fused"] != runs["unfused"], "the fusion changed nothing: it did not run"
