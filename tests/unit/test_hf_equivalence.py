"""ZAYA1 on Megatron-Core equals transformers' ZayaForCausalLM after weight conversion (issue: model)."""

from __future__ import annotations

import pytest
import torch
from zaya_reference import calibrate_skip_bias, hf_config, random_hf_model

from megatron_zaya.config import zaya_config
from megatron_zaya.convert.hf import hf_to_megatron, zaya_kwargs_from_hf
from megatron_zaya.pretrained import build_single_process_model

CONFIGS = {
    "gqa2-conv2x2": dict(),
    "mqa-conv3x4": dict(num_attention_heads=6, num_key_value_heads=1, cca_time0=3, cca_time1=4),
    "mha4-conv1x3": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=8, cca_time0=1, cca_time1=3),
    "sliding": dict(num_hidden_layers=4, sliding_window=3,
                    layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"]),
    "skip-wins": dict(),  # with a skip-class bias that makes it win for about half of the tokens
}


def ours_from_hf(hf_model, dtype=torch.float32):
    cfg = zaya_config(**zaya_kwargs_from_hf(hf_model.config.to_dict()), use_cpu_initialization=True,
                      params_dtype=dtype, moe_token_dispatcher_type="allgather")
    model = build_single_process_model(cfg)
    state = hf_to_megatron(hf_model.state_dict(), cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected
    assert all(k.endswith(("_extra_state", "exp_avg", "exp_avg_sq", "balancing_step")) for k in missing), missing
    return model.to(dtype), cfg


def relative_max_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def reference_model(name: str):
    hf_model = random_hf_model(hf_config(**CONFIGS[name]), seed=len(name))
    if name == "skip-wins":
        calibrate_skip_bias(hf_model, torch.randint(0, hf_model.config.vocab_size, (3, 13)))
    return hf_model


@pytest.fixture(params=sorted(CONFIGS))
def pair(request):
    hf_model = reference_model(request.param)
    ours, cfg = ours_from_hf(hf_model)
    return request.param, hf_model, ours, cfg


def test_logits_match_transformers(pair):
    name, hf_model, ours, cfg = pair
    ids = torch.randint(0, cfg.vocab_size, (3, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_model(ids).logits
        logits = ours.eval()(ids)
    assert logits.shape == ref.shape == (3, 13, cfg.vocab_size)
    assert relative_max_error(logits, ref) <= 1e-5, name


def test_skip_class_wins_for_some_tokens():
    """The skip-wins config really exercises the skip path: some tokens, not all, pick the skip class."""
    ours, cfg = ours_from_hf(reference_model("skip-wins"))
    chosen = []
    router = ours.decoder.layers[0].mlp.router
    hook = router.register_forward_hook(lambda mod, args, out: chosen.append(mod.skip_gate > 0))
    with torch.no_grad():
        ours.eval()(torch.randint(0, cfg.vocab_size, (3, 13), generator=torch.Generator().manual_seed(1)))
    hook.remove()
    skipped = chosen[0].float().mean().item()
    assert 0.2 < skipped < 0.8, skipped


def test_gradients_match_transformers(pair):
    name, hf_model, ours, cfg = pair
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    weights = torch.randn(2, 11, cfg.vocab_size, generator=torch.Generator().manual_seed(3))
    (hf_model(ids).logits * weights).sum().backward()
    (ours.train()(ids) * weights).sum().backward()
    ref_grads = {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in hf_model.named_parameters()}
    ref_grads.update({k: torch.zeros_like(b) for k, b in hf_model.named_buffers() if "balancing" in k})
    expected = hf_to_megatron(ref_grads, cfg)
    params = dict(ours.named_parameters())
    assert set(params) == {k for k in expected if not k.endswith("balancing_biases")}
    unused = "decoder.layers.0.mlp.router.eda_scale"  # the first MoE layer has no router state to scale
    assert not params.pop(unused).grad.any()
    for key, param in params.items():
        assert param.grad is not None, key
        ref = expected[key].double()
        error = ((param.grad.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        assert error <= 1e-4, (name, key, error)


def test_bf16_forward_close_to_fp32_reference():
    hf_model = random_hf_model(hf_config(), seed=5)
    ours, cfg = ours_from_hf(hf_model, dtype=torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf_model(ids).logits
        logits = ours.eval()(ids)
    assert logits.dtype == torch.float32  # fp32 LM head
    assert relative_max_error(logits, ref) <= 2e-2
