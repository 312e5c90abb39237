"""One ZayaMuon step equals a plain reference Muon written here (float32, <= 1e-6), and resumes exactly."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from megatron_zaya.ops.newton_schulz import QUINTIC_COEFFICIENTS
from megatron_zaya.optim import MatrixLayout, MuonConfig, ZayaMuon, classify_named_parameters

QUINTIC = (QUINTIC_COEFFICIENTS,) * 5
SHAPES = {  # ZAYA1-like names (shrunk), each with the matrices a reference Muon cuts it into
    "decoder.layers.0.self_attention.linear_q.weight": (16, 12),
    "decoder.layers.0.self_attention.linear_v.weight": (8, 12),  # value-current / value-delayed halves
    "decoder.layers.0.self_attention.linear_proj.weight": (12, 16),
    "decoder.layers.0.mlp.router.out_proj.weight": (5, 6),
    "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight": (10, 12),  # [gate; up]
    "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight": (12, 5),
    "decoder.layers.0.mlp.experts.weight1": (3, 10, 12),  # grouped: one matrix per expert slice
}


def reference_matrices(name: str, shape, split_gate_up: bool) -> list[tuple]:
    """Index tuples of the independent matrices of a parameter, written out per role."""
    if name.endswith("linear_v.weight") or (split_gate_up and name.endswith("linear_fc1.weight")):
        half = shape[0] // 2
        return [(slice(0, half),), (slice(half, None),)]
    if name.endswith("weight1"):
        if split_gate_up:
            half = shape[1] // 2
            return [(s, slice(0, half)) for s in range(shape[0])] + [(s, slice(half, None)) for s in range(shape[0])]
        return [(s,) for s in range(shape[0])]
    return [(slice(None),)]


def reference_newton_schulz(M: torch.Tensor, coefficients, eps: float = 1e-7) -> torch.Tensor:
    X = M / (M.norm() + eps)
    transposed = X.shape[0] > X.shape[1]
    if transposed:
        X = X.T
    for a, b, c in coefficients:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if transposed else X


def reference_muon_step(weights, grads, momenta, lrs, wds, *, momentum, nesterov, split_gate_up, update_rms=0.2):
    """In place on ``weights`` / ``momenta`` (dicts by name), Liu et al.'s Muon with AdamW RMS matching."""
    for name, w in weights.items():
        momenta[name] = momentum * momenta[name] + grads[name]
        u = grads[name] + momentum * momenta[name] if nesterov else momenta[name]
        new = w * (1 - lrs[name] * wds[name])
        for index in reference_matrices(name, w.shape, split_gate_up):
            block = u[index]
            scale = update_rms * math.sqrt(max(block.shape))
            new[index] -= lrs[name] * scale * reference_newton_schulz(block, QUINTIC)
        weights[name] = new


def make_problem(seed: int, split_gate_up: bool):
    gen = torch.Generator().manual_seed(seed)
    params = {name: torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.1) for name, shape in SHAPES.items()}
    roles = classify_named_parameters(params.items(), split_gate_up=split_gate_up)
    layouts = {p: role.layout for p, (_, role) in roles.items()}
    names = list(params)
    groups = [  # two groups with their own lr / weight decay, as Megatron's scheduler would set them
        {"params": [params[n] for n in names[:3]], "lr": 0.02, "weight_decay": 0.1},
        {"params": [params[n] for n in names[3:]], "lr": 0.05, "weight_decay": 0.0},
    ]
    lrs = {n: (0.02 if i < 3 else 0.05) for i, n in enumerate(names)}
    wds = {n: (0.1 if i < 3 else 0.0) for i, n in enumerate(names)}
    return params, groups, layouts, lrs, wds, gen


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("split_gate_up", [False, True])
def test_steps_match_reference_muon(nesterov, split_gate_up):
    params, groups, layouts, lrs, wds, gen = make_problem(0, split_gate_up)
    config = MuonConfig(momentum=0.9, nesterov=nesterov, ns_dtype=torch.float32, backend="torch",
                        split_gate_up=split_gate_up)  # fmt: skip
    optimizer = ZayaMuon(groups, config=config, layouts=layouts)
    weights = {n: p.detach().clone() for n, p in params.items()}
    momenta = {n: torch.zeros_like(p) for n, p in params.items()}
    for _ in range(3):  # momentum only matters from the second step on
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in params.items()}
        for n, p in params.items():
            p.grad = grads[n].clone()
        optimizer.step()
        reference_muon_step(weights, grads, momenta, lrs, wds, momentum=0.9, nesterov=nesterov,
                            split_gate_up=split_gate_up)  # fmt: skip
        for n, p in params.items():
            assert (p.detach() - weights[n]).abs().max() <= 1e-6, n
            state = optimizer.state[p]["momentum"]
            stored = torch.stack([state[s] for s in sorted(state)]) if p.dim() == 3 else state[0]
            assert (stored - momenta[n]).abs().max() <= 1e-6, n


def test_update_rms_matches_adamw():
    """0.2·√max(rows, cols) makes the update's RMS 0.2·lr, up to the spread of the singular-value band."""
    shapes = [(64, 256), (256, 64), (128, 128)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    optimizer = ZayaMuon(params, lr=1.0, config=MuonConfig(ns_dtype=torch.float32, momentum=0.0, nesterov=False))
    for p in params:
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
    optimizer.step()
    for p in params:
        rms = p.detach().pow(2).mean().sqrt().item()
        assert 0.2 * 0.7 <= rms <= 0.2 * 1.2, (tuple(p.shape), rms)


def test_resume_from_state_dict_is_exact():
    params, groups, layouts, _, _, gen = make_problem(1, False)
    config = MuonConfig(ns_dtype=torch.float32)
    grads = [{n: torch.randn(p.shape, generator=gen) for n, p in params.items()} for _ in range(3)]

    def run(optimizer, params, steps):
        for g in steps:
            for n, p in params.items():
                p.grad = g[n].clone()
            optimizer.step()

    first = ZayaMuon(groups, config=config, layouts=layouts)
    run(first, params, grads[:2])
    saved_state = copy.deepcopy(first.state_dict())
    saved_params = {n: p.detach().clone() for n, p in params.items()}
    run(first, params, grads[2:])

    resumed_params = {n: torch.nn.Parameter(t.clone()) for n, t in saved_params.items()}
    resumed_layouts = {resumed_params[n]: layouts[params[n]] for n in params}
    names = list(params)
    resumed = ZayaMuon(
        [{"params": [resumed_params[n] for n in names[:3]], "lr": 0.0, "weight_decay": 0.0},
         {"params": [resumed_params[n] for n in names[3:]], "lr": 0.0, "weight_decay": 0.0}],
        config=config, layouts=resumed_layouts,
    )  # fmt: skip
    resumed.load_state_dict(saved_state)  # also restores each group's lr and weight decay
    run(resumed, resumed_params, grads[2:])
    for n in names:
        assert torch.equal(resumed_params[n].detach(), params[n].detach()), n


def test_bad_input_is_reported_clearly():
    p = torch.nn.Parameter(torch.randn(4, 6))
    with pytest.raises(ValueError, match="momentum must be in"):
        MuonConfig(momentum=1.0)
    with pytest.raises(ValueError, match="update-rms must be positive, got 0.0"):
        MuonConfig(update_rms=0.0)
    with pytest.raises(ValueError, match="ns-eps must be at least 0, got -1e-07"):
        MuonConfig(eps=-1e-7)
    with pytest.raises(ValueError, match="kernel must be auto, torch or triton"):
        MuonConfig(backend="cuda")
    with pytest.raises(ValueError, match=r"ns_graphs is a boolean \(--zaya-muon-ns-graphs auto\|off\)"):
        MuonConfig(ns_graphs="on")
    with pytest.raises(ValueError, match="cannot be cut into 3 row blocks"):
        ZayaMuon([p], layouts={p: MatrixLayout(row_blocks=3)})
    with pytest.raises(ValueError, match="orthogonalises 2-D matrices or 3-D stacks"):
        ZayaMuon([torch.nn.Parameter(torch.randn(4))])
    optimizer = ZayaMuon([p])
    with pytest.raises(RuntimeError, match="has no gradient"):
        optimizer.step()
