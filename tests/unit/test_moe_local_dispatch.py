"""ZAYA1's single-rank MoE dispatch (a stable sort by expert on a static-size buffer, no host sync) against
Megatron's alltoall token dispatcher: same loss and gradients, with tokens routed to the skip class."""

from __future__ import annotations

import pytest
import torch

from megatron_zaya.config import zaya_config
from megatron_zaya.model.moe import ZayaMoELayer
from megatron_zaya.pretrained import build_single_process_model


@pytest.mark.parametrize("skip_mode", ["zero", "identity"])
def test_local_dispatch_equals_megatrons_dispatcher(monkeypatch, skip_mode):
    cfg = zaya_config("test", use_cpu_initialization=True, params_dtype=torch.float32,
                      moe_token_dispatcher_type="alltoall", skip_mode=skip_mode)
    torch.manual_seed(0)
    net = build_single_process_model(cfg).train()
    layers = [m for m in net.modules() if isinstance(m, ZayaMoELayer)]
    for layer in layers:  # unbiased: some tokens choose the skip class, the others an expert
        layer.router.balancing_biases.zero_()
    ids = torch.randint(0, cfg.vocab_size, (3, 17), generator=torch.Generator().manual_seed(1))

    def run(local: bool):
        monkeypatch.setattr(ZayaMoELayer, "_sorts_without_host_sync", lambda self: local)
        net.zero_grad(set_to_none=True)
        loss = net(ids, labels=ids)
        loss.sum().backward()
        return loss.detach(), {k: p.grad.clone() for k, p in net.named_parameters() if p.grad is not None}

    ref_loss, ref_grads = run(local=False)
    loss, grads = run(local=True)
    counts = torch.stack([layer.router.tokens_per_class for layer in layers])  # both runs, every layer
    assert (counts[:, -1] > 0).all() and (counts[:, :-1].sum(1) > 0).all()  # skipped and routed tokens
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert set(grads) == set(ref_grads)
    for key, grad in ref_grads.items():
        torch.testing.assert_close(grads[key], grad, rtol=1e-5, atol=1e-7, msg=key)


def test_local_dispatch_is_used_on_one_rank_only():
    cfg = zaya_config("test", use_cpu_initialization=True, params_dtype=torch.float32)
    net = build_single_process_model(cfg)
    layers = [m for m in net.modules() if isinstance(m, ZayaMoELayer)]
    assert layers and all(layer._dispatches_locally() for layer in layers)
