"""zaya-pretrain end to end on CPU with ``--optimizer zaya_muon`` (Muon on matrices, AdamW on the rest, through
Megatron's optimizer setup): the loss falls, and resume is exact."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from zaya_cli import QUICK, losses, pretrain


def _tensors(ckpt_step_dir, tmp_path):
    out = tmp_path / f"{ckpt_step_dir.parent.name}-{ckpt_step_dir.name}.pt"
    dcp_to_torch_save(ckpt_step_dir, out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _loss_csv(path):
    rows = path.read_text().splitlines()[1:]
    return {int(i): float(v) for i, v in (row.split(",") for row in rows)}


def test_loss_falls_and_resume_is_exact(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    common = QUICK + ["--train-iters", "20", "--save-interval", "10", "--optimizer", "zaya_muon", "--lr", "0.02"]

    run = pretrain(common + ["--save", str(full), "--load", str(full)], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    uninterrupted = losses(run.stdout)
    assert sorted(uninterrupted) == list(range(1, 21))
    assert uninterrupted[20] < uninterrupted[1] - 1.0, uninterrupted  # nats/token
    assert (full / "loss.png").stat().st_size > 0
    assert "megatron_zaya.convert.cli export-hf" in run.stdout  # tells the user what to run next

    first = pretrain(common + ["--save", str(part), "--load", str(part), "--exit-interval", "10"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = pretrain(common + ["--save", str(part), "--load", str(part)], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # Per-iteration losses from the loss-curve CSV (full precision), which the resumed launch extends.
    before, after = _loss_csv(full / "loss.csv"), _loss_csv(part / "loss.csv")
    assert sorted(after) == list(range(1, 21))
    assert all(after[i] == before[i] for i in after), (after, before)

    # Every tensor of the final checkpoints (weights, balancing biases and their Adam moments,
    # optimizer state) is bit-identical.
    expected, got = _tensors(full / "iter_0000020", tmp_path), _tensors(part / "iter_0000020", tmp_path)
    assert set(expected) == set(got)
    assert any("balancing_exp_avg_sq" in k for k in expected)
    for key, tensor in expected.items():
        assert torch.equal(tensor, got[key]), key
