"""The ZAYA1 kernel patches call their kernels with the right arguments (checked on CPU, where each kernel
function falls back to its torch reference): the patched model equals the unpatched one."""

from __future__ import annotations

import pytest
import torch

from megatron_zaya.config import zaya_config
from megatron_zaya.pretrained import build_single_process_model


@pytest.fixture
def patched(monkeypatch):
    """Apply the five ZAYA kernel patches' functions directly (their platform is GPU), undone afterwards."""
    from megatron_zaya.model import cca, experts, layer, model, norm, router
    from megatron_zaya.patches import kernels

    for owner, name in ((router, "route_top1"), (router, "router_projection"), (cca, "cca_qk"), (model.ZayaModel, "lm_head_loss"),
                        (experts.ZayaExperts, "forward"), (layer, "norm_residual"), (layer, "merge_and_norm"),
                        (norm.ResidualScaling, "forward")):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # restored by monkeypatch at teardown
    return lambda: (kernels.use_triton_router(), kernels.use_triton_cca(), kernels.use_fused_lm_head(),
                    kernels.use_grouped_experts(), kernels.use_fused_residual())


@pytest.mark.parametrize("packed", [False, True], ids=["one-sequence", "packed-documents"])
def test_patched_model_equals_torch_path(patched, packed):
    cfg = zaya_config("test", use_cpu_initialization=True, params_dtype=torch.float32,
                      moe_token_dispatcher_type="allgather", cca_time0=3)
    net = build_single_process_model(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    # Per sequence: its own document starts, so the RoPE angles differ by sequence too.
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in ([4, 1, 8], [2, 2, 9])])

    def run():
        net.zero_grad(set_to_none=True)
        loss = net(ids, position_ids=positions if packed else None, labels=ids)
        loss.sum().backward()
        return loss.detach(), {k: p.grad.clone() for k, p in net.named_parameters() if p.grad is not None}

    ref_loss, ref_grads = run()
    patched()
    loss, grads = run()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(ref_grads)
    for key, grad in ref_grads.items():
        torch.testing.assert_close(grads[key], grad, rtol=1e-4, atol=1e-6, msg=key)


def test_checkpoints_interchange_with_and_without_patches(patched, tmp_path):
    """Patches change how the model computes, never what it stores: a checkpoint saved with them loads without
    them and the reverse, giving the same logits."""
    from megatron_zaya import checkpoint

    cfg = zaya_config("test", use_cpu_initialization=True, params_dtype=torch.float32,
                      moe_token_dispatcher_type="allgather")
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    plain = build_single_process_model(cfg).eval()
    checkpoint.save(plain, cfg, tmp_path / "plain")
    with torch.no_grad():
        expected = plain(ids)

    patched()
    fused = build_single_process_model(cfg).eval()
    checkpoint.load(fused, tmp_path / "plain")  # saved without patches, loaded with them
    with torch.no_grad():
        torch.testing.assert_close(fused(ids), expected)
    checkpoint.save(fused, cfg, tmp_path / "fused")
    assert checkpoint.read_config(tmp_path / "fused").num_layers == cfg.num_layers
    again = build_single_process_model(cfg).eval()
    checkpoint.load(again, tmp_path / "fused")
    for key, tensor in plain.state_dict().items():
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(again.state_dict()[key], tensor), key
