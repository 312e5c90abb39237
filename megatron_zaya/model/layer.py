"""The ZAYA1 layer and block: ``x = merge(x, CCA(norm(x))); x = merge(x, MoE(norm(x), r))`` (spec §2).

``ZayaTransformerLayer`` is built by Megatron's spec system exactly like a ``TransformerLayer`` (its slots
are ``input_layernorm``, ``self_attention`` = CCA, ``self_attn_bda`` = residual scaling,
``pre_mlp_layernorm``, ``mlp`` = ``ZayaMoELayer``, ``mlp_bda`` = residual scaling); only ``forward``
differs, because ZAYA1 keeps the residual stream in fp32 and threads the router state r from layer to layer.
``ZayaTransformerBlock`` adds the input affine after the embedding and the per-layer RoPE table, and
recomputes every layer in the backward pass with ``--recompute-granularity full``.
"""

from __future__ import annotations

from functools import partial

from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_layer import TransformerLayer

from .norm import InputScaling, residual_dtype


class ZayaTransformerLayer(TransformerLayer):
    """One ZAYA1 block: a CCA sublayer and an MoE sublayer, each merged by residual scaling."""

    @property
    def attention_type(self) -> str:
        return self.config.attention_types[self.layer_number - 1]

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, router_state=None, **unused):
        """``hidden_states [s, b, D]`` (the residual stream) -> ``(hidden_states, router_state [s, b, R])``."""
        dtype = self.config.params_dtype
        residual = hidden_states
        attention_output, _ = self.self_attention(
            self.input_layernorm(residual.to(dtype)), attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb
        )
        residual = self.self_attn_bda(attention_output, residual)
        mlp_output, router_state = self.mlp(self.pre_mlp_layernorm(residual.to(dtype)), router_state=router_state)
        return self.mlp_bda(mlp_output, residual), router_state


def _count_tokens_once(layer, run):
    """``run`` for activation recomputation: the router counts its tokens in the first forward only, not
    again when the layer is recomputed during the backward pass."""
    calls = []

    def forward(hidden_states, router_state):
        layer.mlp.router.count_tokens = not calls
        calls.append(True)
        try:
            return run(hidden_states, router_state=router_state)
        finally:
            layer.mlp.router.count_tokens = True

    return forward


class ZayaTransformerBlock(TransformerBlock):
    """The stack of ZAYA1 layers (of this pipeline stage) and the final RMSNorm."""

    def __init__(self, config, spec, pre_process=True, post_process=True, pg_collection=None, vp_stage=None):
        super().__init__(config=config, spec=spec, pre_process=pre_process, post_process=post_process,
                         pg_collection=pg_collection, vp_stage=vp_stage)
        if pre_process and config.residual_scaling:
            self.input_residual_scaling = InputScaling(config)

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb: dict | None = None, **unused):
        """``hidden_states [s, b, D]`` embeddings -> normalised final hidden states ``[s, b, D]``.

        ``rotary_pos_emb`` maps an attention type ("global" / "sliding") to its RoPE table.
        """
        if not self.pre_process:
            hidden_states = self.input_tensor
        elif self.config.residual_scaling:
            hidden_states = self.input_residual_scaling(hidden_states)
        else:
            hidden_states = hidden_states.to(residual_dtype(self.config))
        router_state = None
        recompute = self.training and self.config.recompute_granularity == "full"
        for layer in self.layers:
            run = partial(layer, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb[layer.attention_type])
            if recompute:
                hidden_states, router_state = tensor_parallel.checkpoint(
                    _count_tokens_once(layer, run), self.config.distribute_saved_activations, hidden_states,
                    router_state,
                )
            else:
                hidden_states, router_state = run(hidden_states, router_state=router_state)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states.to(self.config.params_dtype))
        return hidden_states
