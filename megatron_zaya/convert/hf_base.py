"""The original ZAYA1-base checkpoint layout (Zyphra's ``transformers`` fork): detection and import.

Sources, read to establish this layout (no file of them is copied here):

* Zyphra/transformers, branch ``zaya`` (first commit 2025-11-20, the code released with ZAYA1-base):
  ``src/transformers/models/zaya/{configuration_zaya.py, modeling_zaya.py}``.
* The same fork, branch ``zaya1-legacy`` (2026-05): the same weight layout with scalar config fields.
* The same fork, branch ``zaya1``: ``convert_zaya_weights_to_hf.py``, Zyphra's own converter from this
  layout to the ZAYA1-8B (``transformers``-native) one; its renames agree with the reading below.

What the fork's code establishes
--------------------------------
The model is ``2 L`` alternating *sublayers*: ``model.layers.{2l}`` is CCA, ``model.layers.{2l+1}`` is
MoE. Every sublayer *starts* by merging the previous sublayer's output into the residual stream::

    residual, h = ResScale_k(residual, h)       # h: output of sublayer k-1 (the embeddings for k = 0)
    residual = h + residual                     # sublayer 0: residual = h
    h = mixer_k(RMSNorm_k(residual))

with ``ResScale(r, h) = ((r + residual_bias) * residual_scale, (h + hidden_states_bias) * hidden_states_scale)``;
sublayer 0 has only the hidden-side pair, and ``model.res_scale`` merges the last MoE output before
``model.final_norm``. Each affine therefore belongs to the merge *before* the one ZAYA1-8B names it by:

    layers.0.res_scale.hidden_states_*       -> model.input_hidden_states_*
    layers.{2l+1}.res_scale.*                -> layers.{l}.post_attention_residual_scale.*
    layers.{2l}.res_scale.* (l > 0)          -> layers.{l-1}.post_mlp_residual_scale.*
    model.res_scale.*                        -> layers.{L-1}.post_mlp_residual_scale.*

A token routed to the skip ("MoD") class passes through as ``p_skip * x`` (``skip_mode="identity"``). The
first MoE sublayer has no ``router_states_scale`` (no EDA), as in ZAYA1-8B.

Config schemas: the ZAYA1-base release uses per-sublayer lists (``zaya_layers = ['a', E, 'a', E, ...]``,
``cca_num_q_heads``, ``num_query_groups_list``, ``ffn_hidden_size_list`` = 2 x the expert width (gate and
up rows), ``zaya_mlp_expansion`` = router width); its ``num_hidden_layers`` is stale (120 in the fork's
defaults) and the fork ignores it. Its ``num_attention_heads`` counts *uncompressed* heads (16): the head
width is ``hidden_size // num_attention_heads`` and the fork's attention hard-codes
``num_attention_heads // 2`` query heads. The ``zaya1-legacy`` schema has scalars instead
(``num_hidden_layers`` = sublayers, ``num_experts``, ``num_attention_heads`` = query heads, ``head_dim``).

Not established from a primary source (the released ``config.json`` itself was not available to read):
the exact values it ships (θ = 1e6 and 32k positions per SGLang's mirror of it); so fields whose fork
default changed between versions (``rope_theta``, ``max_position_embeddings``) are required, not
defaulted. How the ``zaya1-legacy`` schema's ``swa_layers`` map to attention masks in eager attention
is not established either; sliding-window layers are rejected.

Differences from our model that are numerics only, not layout: the fork's router RMSNorm uses eps 1e-6
(it reads a ``layernorm_epsilon`` field ZAYA1-base's config does not have; ``zaya1-legacy`` uses
``norm_epsilon``) while ours uses ``layernorm_epsilon`` for every norm; with ``residual_in_fp32: false``
the fork keeps the residual in the parameter dtype while ours is fp32.
"""

from __future__ import annotations

import re

import torch

from ..errors import ConversionError

# Keys whose presence marks the fork's alternating-sublayer config (absent from the ZAYA1-8B schema).
_BASE_MARKERS = ("zaya_layers", "ffn_hidden_size", "ffn_hidden_size_list", "zaya_mlp_expansion", "cca_num_q_heads")
# Keys of the ZAYA1-8B (transformers-native) schema.
_NATIVE_MARKERS = ("moe_intermediate_size", "layer_types", "router_hidden_size")
_RESIDUAL_NAMES = ("hidden_states_scale", "hidden_states_bias", "residual_scale", "residual_bias")


def is_base_layout(hf: dict) -> bool:
    """True for a ``config.json`` of the fork's 2L-sublayer layout, False for the ZAYA1-8B one."""
    base = [k for k in _BASE_MARKERS if k in hf]
    native = [k for k in _NATIVE_MARKERS if k in hf]
    if base and native:
        raise ConversionError(f"config.json mixes the ZAYA1-base schema ({', '.join(base)}) and the ZAYA1-8B "
                              f"schema ({', '.join(native)}); keep the fields of the one its weights use")
    return bool(base)


def _require(hf: dict, key: str):
    if key not in hf:
        raise ConversionError(f"config.json has no {key}, which the ZAYA1-base layout needs")
    return hf[key]


def _uniform(values: list, what: str):
    distinct = set(values)
    if len(distinct) != 1:
        raise ConversionError(f"config.json has different {what} per layer ({sorted(distinct, key=str)}); "
                              "megatron-zaya needs every layer alike")
    return distinct.pop()


def _sublayer_count(hf: dict) -> int:
    layers = hf.get("zaya_layers")
    if layers is None:
        count = hf.get("num_hidden_layers")
        if not isinstance(count, int) or count <= 0 or count % 2:
            raise ConversionError(f"config.json has num_hidden_layers={count!r}; the ZAYA1-base layout needs an "
                                  "even number of alternating CCA/MoE sublayers")
        return count
    if len(layers) % 2 or not layers or any(a != "a" for a in layers[::2]) \
            or not all(isinstance(e, int) and e > 0 for e in layers[1::2]):
        raise ConversionError(f"config.json zaya_layers={layers[:4]}... is not the alternating ['a', E, 'a', E, ...] "
                              "of ZAYA1 (CCA sublayers even, MoE sublayers odd)")
    return len(layers)


def _per_kind(hf: dict, list_key: str, scalar_key: str, even: bool, what: str):
    """One value for every CCA (``even``) or MoE sublayer, from a per-sublayer list or a scalar field."""
    value = hf.get(list_key) if list_key else None
    if value is None and scalar_key:
        value = hf.get(scalar_key)
    if value is None:
        keys = " or ".join(k for k in (list_key, scalar_key) if k)
        raise ConversionError(f"config.json has no {keys}: cannot read the {what}")
    if isinstance(value, list):
        if len(value) != _sublayer_count(hf):
            raise ConversionError(f"config.json {list_key or scalar_key} has {len(value)} entries for "
                                  f"{_sublayer_count(hf)} sublayers")
        return _uniform(value[0 if even else 1::2], what)
    return value


def _check_supported(hf: dict) -> None:
    unsupported = {
        "cca": (False, "non-CCA attention"), "attention_bias": (True, "attention biases"),
        "lm_head_bias": (True, "an LM-head bias"), "add_bias_linear": (True, "expert biases"),
        "gated_linear_unit": (False, "non-gated experts"), "clamp_temp": (True, "exp(clamp(τ)) key temperatures"),
    }
    for key, (bad, what) in unsupported.items():
        if key in hf and bool(hf[key]) == bad:
            raise ConversionError(f"config.json sets {key}={hf[key]}: {what}, which ZAYA1 never uses and "
                                  "megatron-zaya cannot express")
    if hf.get("activation_func", "swiglu") != "swiglu":
        raise ConversionError(f"config.json has activation_func={hf['activation_func']!r}; ZAYA1 experts are swiglu")
    if hf.get("moe_router_topk", 1) != 1:
        raise ConversionError("ZAYA1 routes top-1; config.json has moe_router_topk != 1")
    if hf.get("sliding_window") or any(hf.get("swa_layers") or []):
        raise ConversionError("config.json has sliding-window layers (sliding_window / swa_layers); their mapping "
                              "from the ZAYA1-base layout is not established, so they are not imported")
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if not (rope_type == "default" or (rope_type == "linear" and rope.get("factor", 1.0) == 1.0)):
        raise ConversionError(f"config.json uses {rope_type!r} RoPE scaling; only plain RoPE is supported")


def base_kwargs_from_hf(hf: dict) -> dict:
    """ZayaConfig keyword arguments from a ZAYA1-base layout ``config.json`` dict."""
    _check_supported(hf)
    sublayers = _sublayer_count(hf)
    hidden, heads = _require(hf, "hidden_size"), _require(hf, "num_attention_heads")
    if "zaya_layers" in hf:
        experts = _uniform(hf["zaya_layers"][1::2], "expert counts")
        q_heads = _per_kind(hf, "cca_num_q_heads", None, True, "query heads")
        if 2 * q_heads != heads or hidden % heads:
            raise ConversionError(f"config.json has cca_num_q_heads={q_heads}, num_attention_heads={heads}, "
                                  f"hidden_size={hidden}; the fork's attention needs num_attention_heads = "
                                  "2 * cca_num_q_heads, dividing hidden_size")
        head_dim = hidden // heads  # num_attention_heads counts uncompressed heads
    else:
        experts, q_heads, head_dim = _require(hf, "num_experts"), heads, hf.get("head_dim", 128)
    kv_heads = _per_kind(hf, "num_query_groups_list", "num_query_groups", True, "KV heads")
    if kv_heads != hf.get("num_key_value_heads", kv_heads):
        raise ConversionError(f"config.json has {kv_heads} CCA KV heads but num_key_value_heads="
                              f"{hf['num_key_value_heads']}; they must agree")
    fc1_rows = _per_kind(hf, "ffn_hidden_size_list", "ffn_hidden_size", False, "expert widths")
    router = _per_kind(hf, None, "zaya_mlp_expansion", False, "router widths")
    rope = hf.get("rope_parameters") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta"))
    for key, value in (("rope_theta", theta), ("max_position_embeddings", hf.get("max_position_embeddings"))):
        if value is None:  # the fork's defaults for these changed between versions: do not guess
            raise ConversionError(f"config.json has no {key}; add the value the checkpoint was trained with")
    return dict(
        num_layers=sublayers // 2, hidden_size=hidden, num_attention_heads=q_heads, num_query_groups=kv_heads,
        kv_channels=head_dim, ffn_hidden_size=fc1_rows // 2, num_moe_experts=experts, router_hidden_size=router,
        vocab_size=_require(hf, "vocab_size"), max_position_embeddings=hf["max_position_embeddings"],
        layernorm_epsilon=hf.get("norm_epsilon", 1e-5), tie_embeddings=hf.get("tie_word_embeddings", True),
        cca_time0=hf.get("cca_time0", 2), cca_time1=hf.get("cca_time1", 2),
        rotary_percent=rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5)),
        rotary_base=float(theta), skip_class=hf.get("zaya_use_mod", True), skip_mode="identity",
    )


# ---------------------------------------------------------------------------------------------- weights
# Suffix renames inside a sublayer: the fork's name -> the ZAYA1-8B name (first match wins).
_CCA_RENAMES = (
    ("self_attn.qkv.linear_q.", "self_attn.qkv_proj.q_proj."),
    ("self_attn.qkv.linear_k.", "self_attn.qkv_proj.k_proj."),
    ("self_attn.qkv.val_proj1.", "self_attn.qkv_proj.v_proj_current."),
    ("self_attn.qkv.val_proj2.", "self_attn.qkv_proj.v_proj_delayed."),
    ("self_attn.qkv.conv_qk.0.", "self_attn.qkv_proj.conv_qk_depthwise."),
    ("self_attn.qkv.conv_qk.1.", "self_attn.qkv_proj.conv_qk_grouped."),
    ("self_attn.qkv.temp", "self_attn.qk_norm.temp"),
    ("self_attn.o_proj.", "self_attn.o_proj."),
    ("input_norm.", "input_layernorm."),
)
_MOE_RENAMES = (
    ("zaya_block.router.rmsnorm_eda.", "mlp.gate.router_mlp.norm."),
    ("zaya_block.router.router_mlp.0.", "mlp.gate.router_mlp.fc1."),
    ("zaya_block.router.router_mlp.2.", "mlp.gate.router_mlp.fc2."),
    ("zaya_block.router.router_mlp.4.", "mlp.gate.router_mlp.out_proj."),
    ("zaya_block.router.down_proj.", "mlp.gate.down_proj."),
    ("zaya_block.router.router_states_scale", "mlp.gate.router_states_scale"),
    ("zaya_block.router.balancing_biases", "mlp.gate.balancing_biases"),
    ("input_norm.", "post_attention_layernorm."),
)
_SUBLAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"zaya_block\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight")


def _rename(rest: str, renames) -> str | None:
    for old, new in renames:
        if rest.startswith(old):
            return new + rest.removeprefix(old)
    return None


def _residual_target(sublayer: int, name: str) -> str | None:
    """The ZAYA1-8B name of the merge affine that sublayer ``sublayer`` (2L: ``model.res_scale``) applies first."""
    if sublayer == 0:
        return f"model.input_{name}" if name.startswith("hidden_states_") else None
    if sublayer % 2:
        return f"model.layers.{sublayer // 2}.post_attention_residual_scale.{name}"
    return f"model.layers.{sublayer // 2 - 1}.post_mlp_residual_scale.{name}"


def base_weights_to_hf(weights: dict[str, torch.Tensor], hf: dict) -> dict[str, torch.Tensor]:
    """The same tensors under ZAYA1-8B (``transformers``-native) names, ready for ``hf_to_megatron``.

    Experts are stacked (``linear_fc1 [2F, D]`` x E -> ``gate_up_proj [E, 2F, D]``). Switched-off features
    (``scale_residual_merge`` / ``zaya_use_eda`` false) get the neutral values that make our always-present
    parameters exact no-ops (α = 1, β = 0; EDA scale 0).
    """
    num_layers = _sublayer_count(hf) // 2
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}

    def put(key: str, tensor: torch.Tensor) -> None:
        if key in out:
            raise ConversionError(f"two tensors of the checkpoint map to {key}; is it a ZAYA1-base layout?")
        out[key] = tensor

    for key, tensor in weights.items():
        target = {"model.embed_tokens.weight": key, "lm_head.weight": key,
                  "model.final_norm.weight": "model.norm.weight"}.get(key)
        if target is None and key.startswith("model.res_scale."):
            target = _residual_target(2 * num_layers, key.removeprefix("model.res_scale."))
        match = _SUBLAYER.fullmatch(key)
        if match and int(match.group(1)) < 2 * num_layers:
            sublayer, rest = int(match.group(1)), match.group(2)
            layer, is_moe = sublayer // 2, sublayer % 2 == 1
            expert = _EXPERT.fullmatch(rest) if is_moe else None
            if expert:
                name = "gate_up_proj" if expert.group(2) == "1" else "down_proj"
                experts.setdefault((layer, name), {})[int(expert.group(1))] = tensor
                continue
            if rest.startswith("res_scale."):
                target = _residual_target(sublayer, rest.removeprefix("res_scale."))
            else:
                renamed = _rename(rest, _MOE_RENAMES if is_moe else _CCA_RENAMES)
                target = renamed and f"model.layers.{layer}.{renamed}"
        if target is None:
            raise ConversionError(f"unexpected tensor {key!r} for the ZAYA1-base layout of {2 * num_layers} "
                                  "alternating CCA/MoE sublayers that config.json describes; do they belong together?")
        put(target, tensor)

    for (layer, name), by_index in sorted(experts.items()):
        if sorted(by_index) != list(range(len(by_index))):
            raise ConversionError(f"sublayer {2 * layer + 1} has experts {sorted(by_index)}: some are missing")
        put(f"model.layers.{layer}.mlp.experts.{name}", torch.stack([by_index[e] for e in range(len(by_index))]))
    _fill_switched_off(out, hf, num_layers)
    return out


def _fill_switched_off(out: dict[str, torch.Tensor], hf: dict, num_layers: int) -> None:
    dtype = out["model.embed_tokens.weight"].dtype if "model.embed_tokens.weight" in out else torch.float32
    if not hf.get("scale_residual_merge", True):
        ones, zeros = torch.ones(hf["hidden_size"], dtype=dtype), torch.zeros(hf["hidden_size"], dtype=dtype)
        out.update({"model.input_hidden_states_scale": ones, "model.input_hidden_states_bias": zeros})
        for layer in range(num_layers):
            for merge in ("post_attention_residual_scale", "post_mlp_residual_scale"):
                for name in _RESIDUAL_NAMES:
                    out[f"model.layers.{layer}.{merge}.{name}"] = ones if name.endswith("scale") else zeros
    if not hf.get("zaya_use_eda", True):
        width = _per_kind(hf, None, "zaya_mlp_expansion", False, "router widths")
        for layer in range(1, num_layers):
            out[f"model.layers.{layer}.mlp.gate.router_states_scale"] = torch.zeros(width, dtype=dtype)
