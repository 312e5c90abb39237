"""ZayaConfig: presets match the released shapes, invalid combinations fail in one line."""

from __future__ import annotations

import pytest
from transformers import ZayaConfig as HFZayaConfig

from megatron_zaya.config import zaya_config
from megatron_zaya.errors import ZayaConfigError
from megatron_zaya.convert.hf import hf_config_from_zaya


def test_zaya1_8b_preset_is_transformers_default_shape():
    """transformers' ZayaConfig defaults are the released ZAYA1-8B (Zyphra/ZAYA1-8B)."""
    ours = hf_config_from_zaya(zaya_config("zaya1-8b"))
    reference = HFZayaConfig().to_dict()
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "moe_intermediate_size", "num_experts", "router_hidden_size", "cca_time0", "cca_time1",
                "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings"):
        assert ours[key] == reference[key], key
    assert ours["rope_parameters"]["hybrid"]["rope_theta"] == reference["rope_parameters"]["hybrid"]["rope_theta"]
    assert ours["rope_parameters"]["hybrid"]["partial_rotary_factor"] == 0.5


def test_zaya1_base_preset():
    cfg = zaya_config("zaya1-base")
    assert (cfg.max_position_embeddings, cfg.rotary_base, cfg.skip_mode) == (32_768, 1_000_000.0, "identity")


BAD = {
    "heads not divisible by KV heads": (dict(num_attention_heads=6, num_query_groups=4), "num_query_groups"),
    "odd rotary dim": (dict(kv_channels=18, rotary_percent=0.5), "rotary dim"),
    "top-2": (dict(moe_router_topk=2), "top-1"),
    "no experts": (dict(num_moe_experts=None), "num_moe_experts"),
    "sliding without window": (dict(attention_types=["sliding", "global"]), "sliding_window"),
    "a negative sliding window": (dict(attention_types=["sliding", "global"], sliding_window=-4),
                                  "sliding_window=-4"),
    "wrong number of layer types": (dict(attention_types=["global"]), "one type per layer"),
    "unknown layer type": (dict(attention_types=["local", "global"]), "unknown attention types"),
    "unknown skip mode": (dict(skip_mode="drop"), "skip_mode"),
    "conv size": (dict(cca_time0=0), "cca_time0"),
    "a router of no width": (dict(router_hidden_size=0), "--zaya-router-hidden-size 0"),
    "a negative balancing lr": (dict(balancing_lr=-1e-3), "--zaya-balancing-lr -0.001 is negative"),
    "a negative balancing eps": (dict(balancing_eps=-1e-8), "--zaya-balancing-eps -1e-08 is negative"),
    "a balancing beta of 1": (dict(balancing_betas=(0.9, 1.0)), "--zaya-balancing-betas 0.9 1"),
    "unknown recompute module": (dict(recompute_granularity="selective", recompute_modules=["mlp"]),
                                 "recompute-modules"),
    "cuda graphs with recompute": (dict(cuda_graphs=True, recompute_granularity="full", recompute_method="uniform",
                                        recompute_num_layers=1), "recomputation"),
    "cuda graphs with dropout": (dict(cuda_graphs=True, attention_dropout=0.1), "dropout"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_invalid_combinations_fail_in_one_line(case):
    overrides, word = BAD[case]
    with pytest.raises(ZayaConfigError) as error:
        zaya_config("test", **overrides)
    message = str(error.value)
    assert word in message and "\n" not in message and ";" in message  # problem; fix


def test_unknown_preset_and_field():
    with pytest.raises(ZayaConfigError, match="unknown preset 'zaya2'"):
        zaya_config("zaya2")
    with pytest.raises(ZayaConfigError, match="unknown ZayaConfig fields"):
        zaya_config("test", hiden_size=3)
