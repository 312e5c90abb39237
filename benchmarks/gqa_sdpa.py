"""Megatron-Core's GPT-MoE block spec (local, no Transformer Engine) with torch's SDPA as its core attention.

Without Transformer Engine, Megatron's local spec attends with ``DotProductAttention``: it materialises the
[b·heads, S, S] scores, which is slow at 4k and runs out of memory at 32k. This spec keeps every other
module of Megatron's own GPT-MoE and swaps only the core attention for ``F.scaled_dot_product_attention``
(flash kernel, causal, GQA), so that the GQA baseline attends as efficiently as ZAYA1's CCA does.

CLI use (from the repository root): ``--spec benchmarks.gqa_sdpa gqa_sdpa_block_spec``.
"""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.module import MegatronModule


class CausalSDPAttention(MegatronModule):
    """Megatron's core-attention protocol on SDPA: q ``[s, b, heads, d]``, k/v ``[s, b, groups, d]`` -> ``[s, b, heads·d]``."""

    def __init__(self, config, layer_number, attn_mask_type=None, attention_type="self", attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **unused):
        super().__init__(config=config)
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        s, b, heads, d = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                             enable_gqa=k.shape[1] != heads)
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)


def gqa_sdpa_block_spec(config):
    """Megatron's local GPT-MoE decoder block spec with ``CausalSDPAttention``; ``config`` is a
    ``TransformerConfig`` or Megatron's ``GPTModelConfig`` (what ``--spec`` passes)."""
    transformer = getattr(config, "transformer", config)
    block = get_gpt_decoder_block_spec(transformer, use_transformer_engine=False,
                                       normalization=transformer.normalization)
    for layer in block.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = CausalSDPAttention
    return block
