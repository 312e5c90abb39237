"""Hugging Face ``transformers`` ZAYA1 (``ZayaForCausalLM``) <-> megatron-zaya: configs and weights.

Weights are mapped between full (unsharded: TP = EP = PP = 1) state dicts. Every step is a rename, a
slice or a concatenation, so a round trip HF -> Megatron -> HF is bit-identical. The layouts that differ:

* CCA: HF packs the q and k conv channels in one ``Conv1d``; we keep q and k parts apart (each is then a
  contiguous tensor-parallel shard). HF has ``v_proj_current`` / ``v_proj_delayed``; we keep one
  ``linear_v`` whose first half of rows is the current-token value.
* Experts: HF stacks them (``gate_up_proj [E, 2F, D]``, ``down_proj [E, D, F]``); Megatron's
  ``SequentialMLP`` has one ``linear_fc1`` / ``linear_fc2`` per expert (same [gate; up] row order).
"""

from __future__ import annotations

import torch

from ..config import ZayaConfig
from ..errors import ConversionError
from .hf_base import base_kwargs_from_hf, is_base_layout

HF_LAYER_TYPES = {"hybrid": "global", "hybrid_sliding": "sliding"}
ZAYA_LAYER_TYPES = {v: k for k, v in HF_LAYER_TYPES.items()}


# ---------------------------------------------------------------------------------------------- configs
def zaya_kwargs_from_hf(hf: dict) -> dict:
    """ZayaConfig keyword arguments from a ``transformers`` ZAYA ``config.json`` dict."""
    if hf.get("model_type") != "zaya":
        raise ConversionError(f"config.json has model_type={hf.get('model_type')!r}, not 'zaya'")
    if is_base_layout(hf):
        return base_kwargs_from_hf(hf)
    for flag in ("attention_bias", "lm_head_bias"):
        if hf.get(flag):
            raise ConversionError(f"config.json sets {flag}=true, which ZAYA1 checkpoints never use")
    if hf.get("num_experts_per_tok", 1) != 1:
        raise ConversionError("ZAYA1 routes top-1; config.json has num_experts_per_tok != 1")
    rope = hf.get("rope_parameters") or {}
    layer_types = hf.get("layer_types") or ["hybrid"] * hf["num_hidden_layers"]
    unknown = set(layer_types) - set(HF_LAYER_TYPES)
    if unknown:
        raise ConversionError(f"config.json has unknown layer_types {sorted(unknown)}")
    globl, sliding = rope.get("hybrid", {}), rope.get("hybrid_sliding", {})
    rotary_percent = globl.get("partial_rotary_factor", 0.5)
    if "hybrid_sliding" in layer_types and sliding.get("partial_rotary_factor", rotary_percent) != rotary_percent:
        raise ConversionError("sliding and global layers use different partial_rotary_factor; unsupported")
    return dict(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"], num_query_groups=hf["num_key_value_heads"],
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        ffn_hidden_size=hf["moe_intermediate_size"], num_moe_experts=hf["num_experts"],
        router_hidden_size=hf.get("router_hidden_size", 256), vocab_size=hf["vocab_size"],
        max_position_embeddings=hf["max_position_embeddings"], layernorm_epsilon=hf.get("rms_norm_eps", 1e-5),
        tie_embeddings=hf.get("tie_word_embeddings", True), cca_time0=hf.get("cca_time0", 2),
        cca_time1=hf.get("cca_time1", 2), rotary_percent=rotary_percent,
        rotary_base=float(globl.get("rope_theta", 5_000_000.0)),
        sliding_rotary_base=float(sliding.get("rope_theta", 10_000.0)),
        sliding_window=hf.get("sliding_window"), attention_types=[HF_LAYER_TYPES[t] for t in layer_types],
        skip_class=True, skip_mode="zero",
    )


def hf_config_from_zaya(cfg: ZayaConfig) -> dict:
    """A ``config.json`` dict for ``transformers``' ``ZayaConfig``; fails where HF cannot express ``cfg``."""
    if not cfg.skip_class or cfg.skip_mode != "zero":
        raise ConversionError(
            "transformers' ZAYA always has a skip class whose tokens output 0; this model uses "
            f"skip_class={cfg.skip_class}, skip_mode={cfg.skip_mode!r}, which it cannot express"
        )
    return {
        "architectures": ["ZayaForCausalLM"], "model_type": "zaya", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.kv_channels, "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.layernorm_epsilon, "tie_word_embeddings": cfg.tie_embeddings,
        "moe_intermediate_size": cfg.moe_ffn_hidden_size, "num_experts": cfg.num_moe_experts,
        "num_experts_per_tok": 1, "router_hidden_size": cfg.router_hidden_size,
        "cca_time0": cfg.cca_time0, "cca_time1": cfg.cca_time1, "attention_bias": False, "lm_head_bias": False,
        "sliding_window": cfg.sliding_window, "layer_types": [ZAYA_LAYER_TYPES[t] for t in cfg.attention_types],
        "rope_parameters": {
            "hybrid": {"rope_type": "default", "rope_theta": cfg.rotary_base,
                       "partial_rotary_factor": cfg.rotary_percent},
            "hybrid_sliding": {"rope_type": "default", "rope_theta": cfg.sliding_rotary_base,
                               "partial_rotary_factor": cfg.rotary_percent},
        },
        "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1,
    }


# ---------------------------------------------------------------------------------------------- weights
# Per-layer one-to-one renames: Megatron suffix -> HF suffix.
_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_q.weight": "self_attn.qkv_proj.q_proj.weight",
    "self_attention.linear_k.weight": "self_attn.qkv_proj.k_proj.weight",
    "self_attention.qk_norm.key_temperature": "self_attn.qk_norm.temp",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.router.down_proj.weight": "mlp.gate.down_proj.weight",
    "mlp.router.down_proj.bias": "mlp.gate.down_proj.bias",
    "mlp.router.eda_scale": "mlp.gate.router_states_scale",
    "mlp.router.norm_weight": "mlp.gate.router_mlp.norm.weight",
    "mlp.router.fc1.weight": "mlp.gate.router_mlp.fc1.weight",
    "mlp.router.fc1.bias": "mlp.gate.router_mlp.fc1.bias",
    "mlp.router.fc2.weight": "mlp.gate.router_mlp.fc2.weight",
    "mlp.router.fc2.bias": "mlp.gate.router_mlp.fc2.bias",
    "mlp.router.out_proj.weight": "mlp.gate.router_mlp.out_proj.weight",
    "mlp.router.balancing_biases": "mlp.gate.balancing_biases",
    **{f"{ours}.{name}": f"{theirs}.{name}"
       for ours, theirs in (("self_attn_bda", "post_attention_residual_scale"), ("mlp_bda", "post_mlp_residual_scale"))
       for name in ("hidden_states_scale", "hidden_states_bias", "residual_scale", "residual_bias")},
}
_GLOBAL_RENAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.input_residual_scaling.scale": "model.input_hidden_states_scale",
    "decoder.input_residual_scaling.bias": "model.input_hidden_states_bias",
    "decoder.final_layernorm.weight": "model.norm.weight",
}
_CONV = ("depthwise", "grouped")


def hf_to_megatron(hf: dict[str, torch.Tensor], cfg: ZayaConfig) -> dict[str, torch.Tensor]:
    """Full Megatron state dict (model weights and balancing biases) from an HF ``ZayaForCausalLM`` one."""
    hf = dict(hf)
    out: dict[str, torch.Tensor] = {}

    def take(key: str) -> torch.Tensor:
        if key not in hf:
            raise ConversionError(f"missing tensor {key!r}: not a ZAYA1 checkpoint matching its config.json")
        return hf.pop(key)

    for ours, theirs in _GLOBAL_RENAMES.items():
        out[ours] = take(theirs)
    lm_head = hf.pop("lm_head.weight", None)
    if not cfg.tie_embeddings:
        out["output_layer.weight"] = lm_head if lm_head is not None else take("lm_head.weight")
    q_channels = cfg.num_attention_heads * cfg.kv_channels
    for layer in range(cfg.num_layers):
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        for ours, theirs in _LAYER_RENAMES.items():
            if ours == "mlp.router.eda_scale" and layer == 0:
                # HF's first layer has no EDA scale; ours exists for uniform checkpoints and is unused.
                out[dst + ours] = torch.ones(cfg.router_hidden_size, dtype=out["decoder.final_layernorm.weight"].dtype)
                continue
            out[dst + ours] = take(src + theirs)
        out[dst + "self_attention.linear_v.weight"] = torch.cat(
            [take(src + "self_attn.qkv_proj.v_proj_current.weight"), take(src + "self_attn.qkv_proj.v_proj_delayed.weight")]
        )
        for conv in _CONV:
            for part in ("weight", "bias"):
                packed = take(f"{src}self_attn.qkv_proj.conv_qk_{conv}.{part}")
                out[f"{dst}self_attention.conv.q_{conv}_{part}"] = packed[:q_channels]
                out[f"{dst}self_attention.conv.k_{conv}_{part}"] = packed[q_channels:]
        for name, ours in (("gate_up_proj", "linear_fc1"), ("down_proj", "linear_fc2")):
            for expert, weight in enumerate(take(f"{src}mlp.experts.{name}").unbind(0)):
                out[f"{dst}mlp.experts.local_experts.{expert}.{ours}.weight"] = weight
    if hf:
        raise ConversionError(f"unexpected tensors in the HF checkpoint, e.g. {sorted(hf)[:3]}; is it ZAYA1-8B layout?")
    return out


def _neutral_values(cfg: ZayaConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Values that make HF's always-present parameters a no-op for features this model switched off."""
    values: dict[str, torch.Tensor] = {}
    ones, zeros = torch.ones(cfg.hidden_size, dtype=dtype), torch.zeros(cfg.hidden_size, dtype=dtype)
    if not cfg.residual_scaling:
        values["decoder.input_residual_scaling.scale"] = ones
        values["decoder.input_residual_scaling.bias"] = zeros
        for layer in range(cfg.num_layers):
            for merge in ("self_attn_bda", "mlp_bda"):
                prefix = f"decoder.layers.{layer}.{merge}."
                values.update({prefix + "hidden_states_scale": ones, prefix + "hidden_states_bias": zeros,
                               prefix + "residual_scale": ones, prefix + "residual_bias": zeros})
    if not cfg.router_eda:
        for layer in range(1, cfg.num_layers):
            values[f"decoder.layers.{layer}.mlp.router.eda_scale"] = torch.zeros(cfg.router_hidden_size, dtype=dtype)
    return values


def megatron_to_hf(sd: dict[str, torch.Tensor], cfg: ZayaConfig) -> dict[str, torch.Tensor]:
    """HF ``ZayaForCausalLM`` state dict from a full Megatron one (optimizer-only buffers are dropped)."""
    hf_config_from_zaya(cfg)  # raises if HF cannot express this model
    sd = {**_neutral_values(cfg, sd["decoder.final_layernorm.weight"].dtype), **sd}
    out: dict[str, torch.Tensor] = {}
    for ours, theirs in _GLOBAL_RENAMES.items():
        out[theirs] = sd[ours]
    out["lm_head.weight"] = sd["embedding.word_embeddings.weight"] if cfg.tie_embeddings else sd["output_layer.weight"]
    q_channels = cfg.num_attention_heads * cfg.kv_channels
    half_v = cfg.num_query_groups * cfg.kv_channels // 2
    for layer in range(cfg.num_layers):
        src, dst = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        for ours, theirs in _LAYER_RENAMES.items():
            if ours == "mlp.router.eda_scale" and layer == 0:
                continue
            out[dst + theirs] = sd[src + ours]
        v = sd[src + "self_attention.linear_v.weight"]
        out[dst + "self_attn.qkv_proj.v_proj_current.weight"] = v[:half_v]
        out[dst + "self_attn.qkv_proj.v_proj_delayed.weight"] = v[half_v:]
        for conv in _CONV:
            for part in ("weight", "bias"):
                out[f"{dst}self_attn.qkv_proj.conv_qk_{conv}.{part}"] = torch.cat(
                    [sd[f"{src}self_attention.conv.q_{conv}_{part}"], sd[f"{src}self_attention.conv.k_{conv}_{part}"]]
                )
        for name, ours in (("gate_up_proj", "linear_fc1"), ("down_proj", "linear_fc2")):
            out[f"{dst}mlp.experts.{name}"] = torch.stack(
                [sd[f"{src}mlp.experts.local_experts.{e}.{ours}.weight"] for e in range(cfg.num_moe_experts)]
            )
    return out

