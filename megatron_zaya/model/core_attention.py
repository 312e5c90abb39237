"""Core attention kernels for CCA: causal (optionally sliding-window) GQA softmax attention.

CCA attends in its compressed space with ordinary softmax attention, so any kernel works (architecture
spec §3.7). These classes fill ``CCASubmodules.core_attention`` and follow Megatron's
``CoreAttentionBuilder`` protocol: ``cls(config=, layer_number=, attn_mask_type=, attention_type=, ...)``,
``forward(q, k, v, attention_mask, attn_mask_type=None, ...)`` with q ``[s, b, heads, d]`` and k, v
``[s, b, kv_heads, d]``, returning ``[s, b, heads * d]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule


def sliding_window_mask(q_len: int, kv_len: int, window: int, device: torch.device) -> torch.Tensor:
    """Boolean [q_len, kv_len] mask, True where query i may see key j: ``0 <= i - j < window``."""
    offset = kv_len - q_len
    i = torch.arange(q_len, device=device)[:, None] + offset
    j = torch.arange(kv_len, device=device)[None, :]
    return (j <= i) & (i - j < window)


class SDPAttention(MegatronModule):
    """``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient / math backends).

    Scale ``1/sqrt(d)``. A layer whose ``config.attention_types`` entry is ``"sliding"`` sees the last
    ``config.sliding_window`` tokens (itself included), as ``transformers``' sliding-window mask does.
    """

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 cp_comm_type=None, softmax_scale=None, pg_collection=None, **unused):
        super().__init__(config=config)
        self.window = (
            config.sliding_window if config.attention_types[layer_number - 1] == "sliding" else None
        )
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        s, b, heads, d = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        if self.window is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                 enable_gqa=k.shape[1] != heads)
        else:
            mask = sliding_window_mask(s, k.shape[2], self.window, q.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale,
                                                 enable_gqa=k.shape[1] != heads)
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)
