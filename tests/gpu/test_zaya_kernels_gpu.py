"""On a GPU: the ZAYA1 model with its Triton kernels equals the torch path (loss and gradients, bf16)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).float().mean()
    loss.backward()
    return loss.item(), {k: p.grad.float().clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kernels", ["router,cca,lm_head,experts"])
def test_model_kernels_match_torch_path(kernels):
    from megatron_zaya.config import zaya_config
    from megatron_zaya.pretrained import build_single_process_model

    def build(choice):
        cfg = zaya_config("test", num_layers=3, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                          kv_channels=64, ffn_hidden_size=512, num_moe_experts=8, vocab_size=8192,
                          max_position_embeddings=1024, use_cpu_initialization=True, params_dtype=torch.bfloat16,
                          bf16=True, moe_token_dispatcher_type="allgather", kernels=choice)
        return build_single_process_model(cfg).cuda().train()

    torch.manual_seed(0)
    plain, fused = build("none"), build(kernels)
    fused.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 8192, (2, 512), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    loss_torch, grads_torch = _loss_and_grads(plain, ids)
    loss_fused, grads_fused = _loss_and_grads(fused, ids)
    assert abs(loss_fused - loss_torch) <= 2e-2 * abs(loss_torch), (loss_fused, loss_torch)
    for key, ref in grads_torch.items():
        error = ((grads_fused[key] - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        assert error <= 5e-2, (key, error)
