"""zaya-pretrain end to end on CPU with ``--optimizer zaya_muon`` (Muon on matrices, AdamW on the rest, through
Megatron's optimizer setup): the loss falls, and resume is exact."""

from __future__ import annotations

import re

import torch

from zaya_cli import MUON_RUN, checkpoint_state, differing, loss_csv, losses, pretrain


def test_loss_falls_and_resume_is_exact(muon_run, tmp_path):
    full, part = muon_run / "full", tmp_path / "part"
    stdout = (muon_run / "stdout.log").read_text()
    uninterrupted = losses(stdout)
    assert sorted(uninterrupted) == list(range(1, 21))
    assert uninterrupted[20] < uninterrupted[1] - 1.0, uninterrupted  # nats/token
    assert (full / "loss.png").stat().st_size > 0
    assert "megatron_zaya.convert.cli export-hf" in stdout  # tells the user what to run next

    # The first half with Python's automatic collector, the rest (and the uninterrupted run) with the default
    # collections between steps: when the collector runs changes no number.
    first = pretrain(MUON_RUN + ["--save", str(part), "--load", str(part), "--exit-interval", "10",
                                 "--zaya-gc-interval", "0"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = pretrain(MUON_RUN + ["--save", str(part), "--load", str(part)], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # Per-iteration losses from the loss-curve CSV (full precision), which the resumed launch extends.
    before, after = loss_csv(full / "loss.csv"), loss_csv(part / "loss.csv")
    assert sorted(after) == list(range(1, 21))
    assert all(after[i] == before[i] for i in after), (after, before)

    # Everything in the final checkpoints is bit-identical: weights, balancing biases and their Adam moments,
    # the optimizer's state and step counts, the LR scheduler, the iteration, the RNG states.
    expected, got = checkpoint_state(full / "iter_0000020", tmp_path), checkpoint_state(part / "iter_0000020", tmp_path)
    assert any("balancing_exp_avg_sq" in k for k in expected)
    assert [k for k in expected if k.endswith(("/iteration", "/opt_param_scheduler/num_steps"))] and any(
        "rng_state" in k for k in expected)
    assert differing(expected, got) == []


def test_logged_params_norm_is_the_float64_norm_of_the_saved_weights(muon_run, tmp_path):
    """``--log-params-norm`` (Megatron's, through ``optim.params_norm_on_device``) after steps 10 and 20."""
    logged = {int(step): float(norm) for step, norm in
              re.findall(r"iteration\s+(\d+)/.*?params norm: ([0-9.]+)", (muon_run / "stdout.log").read_text())}
    for step in (10, 20):
        state = checkpoint_state(muon_run / "full" / f"iter_{step:07d}", tmp_path)
        weights = [v for k, v in state.items() if k.split(".")[0] in ("embedding", "decoder") and torch.is_tensor(v)
                   and v.is_floating_point() and "balancing_" not in k]  # the parameters, not the router's buffers
        want = torch.linalg.vector_norm(torch.cat([w.double().flatten() for w in weights])).item()
        assert abs(logged[step] - want) <= 6e-4, (step, logged[step], want)  # printed with 3 decimals


def test_full_recomputation_of_some_layers_trains_as_the_run_without(muon_run, tmp_path):
    """``--recompute-method block --recompute-num-layers 1``: the first layer recomputed in the backward, the others
    keeping their activations; the losses are those of the run that recomputes nothing."""
    expected = losses((muon_run / "stdout.log").read_text())
    run = pretrain(MUON_RUN + ["--exit-interval", "4", "--recompute-granularity", "full", "--recompute-method", "block",
                               "--recompute-num-layers", "1"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    got = losses(run.stdout)
    assert sorted(got) == [1, 2, 3, 4]
    assert all(abs(got[i] - expected[i]) <= 1e-5 * expected[i] for i in got), (got, expected)
