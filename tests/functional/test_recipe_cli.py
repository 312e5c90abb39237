"""ZAYA1's recipe flags through the zaya-pretrain CLI (Adam): router freeze, expert clipping, the expert-load warning.

The routers are frozen for the first 2 steps' tokens (8 sequences of 64 per step): their weights are bit for bit
those of the step-1 checkpoint at step 2 and change at step 3, while every other weight changes every step. A run
resumed from the step-2 checkpoint thaws at the same step and ends in the uninterrupted run's step-4 checkpoint,
bit for bit. The same flags under ZeRO-1 Muon, whose AdamW half (the routers' vectors among its parameters) is
Megatron's distributed optimizer: the first stage of test_stage_transitions.py.
"""

from __future__ import annotations

import re

import torch
from zaya_cli import QUICK, checkpoint_state, differing, losses, pretrain

STEP_TOKENS = 8 * 64
RECIPE = ["--zaya-router-freeze-tokens", str(2 * STEP_TOKENS), "--zaya-expert-clip-grad", "0.05",
          "--zaya-expert-load-warn-ratio", "1.0", "--zaya-expert-load-warn-intervals", "2"]
THAW = re.compile(r"\[zaya\] routers thaw at iteration (\d+): 1024 tokens consumed")


def _router(key: str) -> bool:
    return ".router." in key and ".balancing_" not in key


def _states(save, steps, scratch):
    return {step: checkpoint_state(save / f"iter_{step:07d}", scratch) for step in steps}


def _assert_frozen_until(states: dict, thaw: int, named_moments: bool = False) -> None:
    """Router weights as at step 1 up to ``thaw - 1``, new at ``thaw``; every other weight new at every step. With
    ``named_moments`` (an optimizer state saved by parameter, as ZayaMuon's momentum), the routers' is not zero."""
    first = states[min(states)]
    weights = [k for k in first if k.startswith(("decoder.", "embedding.")) and isinstance(first[k], torch.Tensor)]
    routers = [k for k in weights if _router(k)]
    assert routers and len(routers) < len(weights)
    for step in sorted(states)[1:]:
        changed = {k for k in weights if not torch.equal(states[step - 1][k], states[step][k])}
        assert changed >= set(weights) - set(routers), (step, set(weights) - set(routers) - changed)
        assert changed & set(routers) == (set(routers) if step >= thaw else set()), step
    if named_moments:  # the frozen routers' moments still fill
        moments = [k for k in first if "optimizer.state.zaya_muon_momentum." in k and _router(k)]
        assert moments and all(first[k].abs().sum() > 0 for k in moments)


def test_router_freeze_expert_clip_and_load_warning_resume_exactly(tmp_path):
    common = QUICK + ["--train-iters", "4", "--save-interval", "1", *RECIPE]
    full = tmp_path / "full"
    run = pretrain(common + ["--save", str(full)], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [int(i) for i in THAW.findall(run.stdout)] == [3], run.stdout[-3000:]
    norms = re.findall(r"iteration\s+(\d+) \| expert grad norm: ([0-9.]+) \| expert clip: 0.05 \|", run.stdout)
    assert [int(i) for i, _ in norms] == [1, 2, 3, 4] and any(float(n) > 0.05 for _, n in norms), norms
    warnings = re.findall(r"warning: iteration\s+(\d+) \| layer (\d)'s busiest expert has taken more than 1x an even "
                          r"share for 2 log intervals", run.stdout)
    by_layer = {layer: [int(i) for i, warned in warnings if warned == layer] for _, layer in warnings}
    # each layer warns after 2 intervals over the ratio, then only after dropping under and 2 more over
    assert by_layer and all(its[0] >= 2 and all(b - a >= 3 for a, b in zip(its, its[1:])) for its in by_layer.values())
    states = _states(full, range(1, 5), tmp_path)
    _assert_frozen_until(states, thaw=3)

    resumed_dir = tmp_path / "resumed"
    resumed = pretrain(common + ["--load", str(full), "--ckpt-step", "2", "--save", str(resumed_dir)], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [int(i) for i in THAW.findall(resumed.stdout)] == [3], resumed.stdout[-3000:]
    after, before = losses(resumed.stdout), losses(run.stdout)
    assert sorted(after) == [3, 4] and all(after[i] == before[i] for i in after), (after, before)
    assert differing(states[4], checkpoint_state(resumed_dir / "iter_0000004", tmp_path)) == []
