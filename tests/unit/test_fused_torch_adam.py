"""``optim.fused_torch_adam``: Megatron's torch AdamW switched to torch's fused kernel takes AdamW's steps.

torch's fused AdamW also runs on CPU, so the switch is checked here against a float64 AdamW written out in
the test; on a GPU the patch applies to every run, so the Adam runs of tests/gpu/test_training_gpu.py train with it.
"""

from __future__ import annotations

import types

import pytest
import torch

from megatron_zaya.optim.megatron import fuse_torch_adam

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1


def reference_adamw(params, grads_per_step):
    """Decoupled-weight-decay Adam in float64, one step per entry of ``grads_per_step``."""
    params = [p.double().clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t, grads in enumerate(grads_per_step, start=1):
        for p, g, m_i, v_i in zip(params, (g.double() for g in grads), m, v):
            p.mul_(1 - LR * WD)
            m_i.mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
            v_i.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
            denom = (v_i / (1 - BETAS[1] ** t)).sqrt().add_(EPS)
            p.addcdiv_(m_i, denom, value=-LR / (1 - BETAS[0] ** t))
    return params


def test_fused_adamw_takes_adamw_steps():
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(7, 5, generator=gen), torch.randn(11, generator=gen)]
    grads_per_step = [[torch.randn(p.shape, generator=gen) for p in start] for _ in range(3)]
    params = [torch.nn.Parameter(p.clone()) for p in start]
    inner = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    assert fuse_torch_adam(types.SimpleNamespace(optimizer=inner))
    assert all(group["fused"] and not group["foreach"] for group in inner.param_groups)
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        inner.step()
    for ours, ref in zip(params, reference_adamw(start, grads_per_step)):
        torch.testing.assert_close(ours.detach().double(), ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", ["stepped", "sgd", "no_optimizer"])
def test_left_alone(case):
    param = torch.nn.Parameter(torch.ones(3))
    if case == "stepped":
        inner = torch.optim.AdamW([param])
        param.grad = torch.ones(3)
        inner.step()
    elif case == "sgd":
        inner = torch.optim.SGD([param], lr=0.1)
    else:
        inner = None
    assert not fuse_torch_adam(types.SimpleNamespace(optimizer=inner))
    if inner is not None:
        assert not any(group.get("fused") for group in inner.param_groups)
