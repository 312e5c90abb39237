"""Importing the original ZAYA1-base layout (80 alternating sublayers, Zyphra's transformers fork).

A random ZAYA1-8B-layout model (the transformers oracle) is re-expressed, in this test, in the fork's
layout: names from the fork's ``modeling_zaya.py`` and each residual affine moved to the sublayer that
applies it first. Both directories are imported; the logits must be identical and match transformers.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from zaya_reference import hf_config, random_hf_model

from megatron_zaya import load_pretrained
from megatron_zaya.convert.cli import main as convert
from megatron_zaya.pretrained import load_hf

LAYERS, THETA = 3, 250_000.0
# hidden = 2 * heads * head_dim: the fork's list schema derives the head width from the uncompressed head count.
SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=LAYERS,
             rope_parameters={"hybrid": {"rope_type": "default", "rope_theta": THETA, "partial_rotary_factor": 0.5}})
IDS = torch.randint(0, 384, (2, 11), generator=torch.Generator().manual_seed(3))

# ZAYA1-8B name (inside model.layers.{l}.) -> the fork's name inside its sublayer, and which sublayer.
CCA, MOE = 0, 1
PER_LAYER = {
    "input_layernorm.weight": (CCA, "input_norm.weight"),
    "self_attn.qkv_proj.q_proj.weight": (CCA, "self_attn.qkv.linear_q.weight"),
    "self_attn.qkv_proj.k_proj.weight": (CCA, "self_attn.qkv.linear_k.weight"),
    "self_attn.qkv_proj.v_proj_current.weight": (CCA, "self_attn.qkv.val_proj1.weight"),
    "self_attn.qkv_proj.v_proj_delayed.weight": (CCA, "self_attn.qkv.val_proj2.weight"),
    "self_attn.qkv_proj.conv_qk_depthwise.weight": (CCA, "self_attn.qkv.conv_qk.0.weight"),
    "self_attn.qkv_proj.conv_qk_depthwise.bias": (CCA, "self_attn.qkv.conv_qk.0.bias"),
    "self_attn.qkv_proj.conv_qk_grouped.weight": (CCA, "self_attn.qkv.conv_qk.1.weight"),
    "self_attn.qkv_proj.conv_qk_grouped.bias": (CCA, "self_attn.qkv.conv_qk.1.bias"),
    "self_attn.qk_norm.temp": (CCA, "self_attn.qkv.temp"),
    "self_attn.o_proj.weight": (CCA, "self_attn.o_proj.weight"),
    "post_attention_layernorm.weight": (MOE, "input_norm.weight"),
    "mlp.gate.down_proj.weight": (MOE, "zaya_block.router.down_proj.weight"),
    "mlp.gate.down_proj.bias": (MOE, "zaya_block.router.down_proj.bias"),
    "mlp.gate.router_states_scale": (MOE, "zaya_block.router.router_states_scale"),
    "mlp.gate.router_mlp.norm.weight": (MOE, "zaya_block.router.rmsnorm_eda.weight"),
    "mlp.gate.router_mlp.fc1.weight": (MOE, "zaya_block.router.router_mlp.0.weight"),
    "mlp.gate.router_mlp.fc1.bias": (MOE, "zaya_block.router.router_mlp.0.bias"),
    "mlp.gate.router_mlp.fc2.weight": (MOE, "zaya_block.router.router_mlp.2.weight"),
    "mlp.gate.router_mlp.fc2.bias": (MOE, "zaya_block.router.router_mlp.2.bias"),
    "mlp.gate.router_mlp.out_proj.weight": (MOE, "zaya_block.router.router_mlp.4.weight"),
    "mlp.gate.balancing_biases": (MOE, "zaya_block.router.balancing_biases"),
}


def fork_layout(sd: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """The fork's state dict of the same model. Sublayer k starts by merging sublayer k-1's output, so the
    affine after layer l's CCA lives in sublayer 2l+1, the one after its MoE in sublayer 2l+2 (the last one
    in ``model.res_scale``), and the input affine is sublayer 0's hidden-side half."""
    out = {"model.embed_tokens.weight": sd["model.embed_tokens.weight"],
           "model.final_norm.weight": sd["model.norm.weight"],
           "model.layers.0.res_scale.hidden_states_scale": sd["model.input_hidden_states_scale"],
           "model.layers.0.res_scale.hidden_states_bias": sd["model.input_hidden_states_bias"]}
    for layer in range(layers):
        ours = f"model.layers.{layer}."
        for name, (kind, fork_name) in PER_LAYER.items():
            if ours + name in sd:  # layer 0 has no router_states_scale
                out[f"model.layers.{2 * layer + kind}.{fork_name}"] = sd[ours + name]
        for merge, merged_by in (("post_attention_residual_scale", f"model.layers.{2 * layer + 1}.res_scale."),
                                 ("post_mlp_residual_scale", "model.res_scale." if layer == layers - 1
                                  else f"model.layers.{2 * layer + 2}.res_scale.")):
            for name in ("hidden_states_scale", "hidden_states_bias", "residual_scale", "residual_bias"):
                out[merged_by + name] = sd[f"{ours}{merge}.{name}"]
        for name, fc in (("gate_up_proj", "linear_fc1"), ("down_proj", "linear_fc2")):
            for e, weight in enumerate(sd[f"{ours}mlp.experts.{name}"]):
                out[f"model.layers.{2 * layer + 1}.zaya_block.experts.local_experts.{e}.{fc}.weight"] = weight
    return out


def fork_config(hf, schema: str) -> dict:
    """A ``config.json`` in the fork's schema: per-sublayer lists (ZAYA1-base release) or scalars (zaya1-legacy)."""
    common = dict(model_type="zaya", vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
                  max_position_embeddings=hf.max_position_embeddings, norm_epsilon=hf.rms_norm_eps,
                  rope_theta=THETA, partial_rotary_factor=0.5, num_key_value_heads=hf.num_key_value_heads,
                  tie_word_embeddings=True, moe_router_topk=1, zaya_use_mod=True, zaya_use_eda=True,
                  scale_residual_merge=True, activation_func="swiglu", gated_linear_unit=True,
                  add_bias_linear=False, attention_bias=False, lm_head_bias=False, residual_in_fp32=False,
                  sliding_window=None, rope_scaling=None)
    sublayers = 2 * hf.num_hidden_layers
    if schema == "lists":
        def alternate(cca, moe):
            return [cca if k % 2 == 0 else moe for k in range(sublayers)]
        return {**common, "num_hidden_layers": 120,  # stale in the release; zaya_layers counts
                "num_attention_heads": 2 * hf.num_attention_heads, "zaya_layers": alternate("a", hf.num_experts),
                "cca_num_q_heads": alternate(hf.num_attention_heads, 0),
                "num_query_groups_list": alternate(hf.num_key_value_heads, 0),
                "ffn_hidden_size_list": alternate(0, 2 * hf.moe_intermediate_size),
                "zaya_mlp_expansion": alternate(0, hf.router_hidden_size)}
    return {**common, "num_hidden_layers": sublayers, "num_experts": hf.num_experts,
            "num_attention_heads": hf.num_attention_heads, "head_dim": hf.head_dim,
            "num_query_groups": hf.num_key_value_heads, "ffn_hidden_size": 2 * hf.moe_intermediate_size,
            "zaya_mlp_expansion": hf.router_hidden_size, "cca_time0": 2, "cca_time1": 2, "clamp_temp": False,
            "swa_layers": [0] * sublayers}


def write(path, config: dict, weights: dict[str, torch.Tensor]):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in weights.items()}, path / "model.safetensors")
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    hf_model = random_hf_model(hf_config(**SHAPE), seed=5)
    path = tmp_path_factory.mktemp("zaya1-8b") / "hf"
    hf_model.save_pretrained(path)
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(IDS).logits
    return hf_model, path, logits


def _logits(path):
    with torch.no_grad():
        return load_pretrained(path, device="cpu")(IDS)


@pytest.mark.parametrize("schema", ["lists", "scalars"])
def test_base_layout_imports_the_same_model(schema, reference, tmp_path):
    hf_model, native_dir, oracle = reference
    sd = {k: v.detach() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    base_dir = write(tmp_path / "base", fork_config(hf_model.config, schema), fork_layout(sd, LAYERS))

    _, cfg = load_hf(base_dir)
    assert (cfg.num_layers, cfg.skip_mode, cfg.rotary_base) == (LAYERS, "identity", THETA)
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (4, 2, 8)
    base, native = _logits(base_dir), _logits(native_dir)
    assert torch.equal(base, native)
    assert ((base - oracle).abs().max() / oracle.abs().max()).item() <= 1e-5


def _expect_error(capsys, tmp_path, source, words):
    assert convert(["import-hf", str(source), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("zaya-convert: error:") and "\n" not in err and all(w in err for w in words), err
    assert not (tmp_path / "out").exists()


def test_bad_base_layout_input(reference, tmp_path, capsys):
    hf_model, native_dir, _ = reference
    sd = {k: v.detach() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    config = fork_config(hf_model.config, "lists")
    # A base-layout config.json over ZAYA1-8B-layout weights.
    _expect_error(capsys, tmp_path, write(tmp_path / "mixed", config, sd), ["unexpected tensor", "sublayers"])
    # Sublayers that do not alternate CCA, MoE.
    broken = {**config, "zaya_layers": ["a", "a"] + config["zaya_layers"][2:]}
    _expect_error(capsys, tmp_path, write(tmp_path / "order", broken, fork_layout(sd, LAYERS)), ["zaya_layers"])
    # A field whose default changed between fork versions is required, not guessed.
    no_theta = {k: v for k, v in config.items() if k != "rope_theta"}
    _expect_error(capsys, tmp_path, write(tmp_path / "theta", no_theta, fork_layout(sd, LAYERS)), ["rope_theta"])
    # The residual shift is load-bearing: the last merge's affine is required.
    weights = {k: v for k, v in fork_layout(sd, LAYERS).items() if not k.startswith("model.res_scale.")}
    _expect_error(capsys, tmp_path, write(tmp_path / "nofinal", config, weights), ["missing", "post_mlp_residual"])
