"""ZAYA1 balancing biases: the Adam rule on (share - 1/E), checked independently, and that it balances."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron_zaya.config import zaya_config
from megatron_zaya.ops.residual_norm import rms_norm
from megatron_zaya.pretrained import build_single_process_model
from megatron_zaya.training.balancing import step_balancing


def _model(**overrides):
    cfg = zaya_config("test", use_cpu_initialization=True, params_dtype=torch.float32,
                      moe_token_dispatcher_type="allgather", **overrides)
    return build_single_process_model(cfg), cfg


def _adam_reference(counts_per_step, lr, betas, eps, warmup_steps=0):
    """Plain float64 Adam on the biases of the real experts, gradient = share - 1/E, from zero state; the step
    size ramps linearly to ``lr`` over ``warmup_steps`` steps."""
    experts = len(counts_per_step[0])
    bias, m, v = [0.0] * experts, [0.0] * experts, [0.0] * experts
    for step, counts in enumerate(counts_per_step, start=1):
        total = sum(counts)
        step_lr = lr * min(1.0, step / warmup_steps) if warmup_steps else lr
        for e in range(experts):
            g = counts[e] / total - 1.0 / experts
            m[e] = betas[0] * m[e] + (1 - betas[0]) * g
            v[e] = betas[1] * v[e] + (1 - betas[1]) * g * g
            m_hat, v_hat = m[e] / (1 - betas[0] ** step), v[e] / (1 - betas[1] ** step)
            bias[e] -= step_lr * m_hat / (math.sqrt(v_hat) + eps)
    return bias


def test_bias_update_matches_independent_adam():
    model, cfg = _model(balancing_lr=0.01, balancing_betas=(0.8, 0.99), balancing_eps=1e-6)
    router = model.decoder.layers[0].mlp.router
    steps = [[70.0, 10.0, 15.0, 5.0, 9.0], [40.0, 20.0, 25.0, 15.0, 3.0], [25.0, 25.0, 25.0, 25.0, 0.0]]
    nothing_routed = [0.0, 0.0, 0.0, 0.0, 12.0]  # every token skipped: no step, the state stays as it is
    for counts in [nothing_routed, steps[0], steps[1], nothing_routed, steps[2]]:
        router.update_balancing_biases(torch.tensor(counts))
    assert router.balancing_step.item() == len(steps)
    expected = _adam_reference([c[:4] for c in steps], 0.01, (0.8, 0.99), 1e-6)
    torch.testing.assert_close(router.balancing_biases[:4].double(), torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-5, atol=1e-7)
    assert router.balancing_biases[4].item() == cfg.skip_bias_init  # the skip class is not balanced by default
    assert router.balancing_biases.dtype == torch.float32


def test_the_balancing_warm_up_ramps_the_step_size_and_continues_after_a_resume():
    """``balancing_warmup_steps=4``: step sizes lr/4, 2lr/4, 3lr/4, then lr, against float64 Adam; a router
    rebuilt from the first one's state dict after step 2 (a resume) continues the ramp where it was."""
    steps = [[70.0, 10.0, 15.0, 5.0, 0.0], [40.0, 20.0, 25.0, 15.0, 3.0], [25.0, 35.0, 25.0, 15.0, 0.0],
             [10.0, 30.0, 50.0, 10.0, 1.0], [30.0, 20.0, 20.0, 30.0, 0.0], [20.0, 30.0, 30.0, 20.0, 0.0]]
    settings = dict(balancing_lr=0.01, balancing_betas=(0.8, 0.99), balancing_eps=1e-6, balancing_warmup_steps=4)
    first, _ = _model(**settings)
    router = first.decoder.layers[0].mlp.router
    for counts in steps[:2]:
        router.update_balancing_biases(torch.tensor(counts))
    resumed, _ = _model(**settings)
    resumed.load_state_dict(first.state_dict())
    router = resumed.decoder.layers[0].mlp.router
    for counts in steps[2:]:
        router.update_balancing_biases(torch.tensor(counts))
    expected = _adam_reference([c[:4] for c in steps], 0.01, (0.8, 0.99), 1e-6, warmup_steps=4)
    torch.testing.assert_close(router.balancing_biases[:4].double(), torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-5, atol=1e-7)
    without_warmup = _adam_reference([c[:4] for c in steps], 0.01, (0.8, 0.99), 1e-6)
    assert (torch.tensor(expected) - torch.tensor(without_warmup)).abs().max() > 1e-3  # the ramp matters here
    # the first step moves each bias by a quarter of the full step (Adam's first step is lr * sign(gradient))
    fresh, _ = _model(**settings)
    fresh_router = fresh.decoder.layers[0].mlp.router
    fresh_router.update_balancing_biases(torch.tensor(steps[0]))
    torch.testing.assert_close(fresh_router.balancing_biases[:4].abs().double(),
                               torch.full((4,), 0.01 / 4, dtype=torch.float64), rtol=1e-4, atol=0)


def test_skip_class_is_balanced_when_asked():
    model, _ = _model(balancing_lr=0.01, balance_skip_class=True)
    router = model.decoder.layers[0].mlp.router
    router.update_balancing_biases(torch.tensor([70.0, 10.0, 15.0, 5.0, 0.0]))
    expected = _adam_reference([[70.0, 10.0, 15.0, 5.0, 0.0]], 0.01, (0.9, 0.999), 1e-8)
    torch.testing.assert_close(router.balancing_biases.double() - torch.tensor([0, 0, 0, 0, -1.0]).double(),
                               torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-7)


def test_balancing_spreads_a_collapsed_router():
    """A router whose weights send most tokens to expert 0 is spread out by the bias updates alone."""
    torch.manual_seed(0)
    model, cfg = _model(balancing_lr=0.02)
    model.train()
    ids = torch.randint(0, cfg.vocab_size, (4, 32))
    for layer in model.decoder.layers:  # tilt every router's output layer towards expert 0
        router, states = layer.mlp.router, []
        hook = router.register_forward_hook(lambda mod, args, out: states.append(mod.state_out.detach()))
        with torch.no_grad():
            model(ids)
        hook.remove()
        # The router MLP's last hidden features for these tokens (its math, spec §4.3).
        h = rms_norm(states[0], router.norm_weight, cfg.layernorm_epsilon)
        h = F.gelu(F.gelu(F.linear(h, router.fc1.weight, router.fc1.bias)) @ router.fc2.weight.T + router.fc2.bias)
        mean = h.reshape(-1, cfg.router_hidden_size).mean(0)
        with torch.no_grad():
            router.out_proj.weight[0] += 4.0 * mean / mean.pow(2).sum()
        router.tokens_per_class.zero_()

    max_share = []  # the largest expert share, averaged over layers, per step (balanced: 1/E = 0.25)
    for step in range(60):
        with torch.no_grad():
            model(torch.randint(0, cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(step)))
        stats = step_balancing([model])
        max_share.append(sum(s["max share"] for s in stats) / len(stats))
    start, end = sum(max_share[:3]) / 3, sum(max_share[-15:]) / 15
    assert start > 0.8, max_share  # collapsed at the start
    assert end < 0.5 and end < start - 0.3, max_share
    assert all(r.tokens_per_class.sum() == 0 for r in (l.mlp.router for l in model.decoder.layers))
