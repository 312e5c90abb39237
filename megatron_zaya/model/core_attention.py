"""Core attention kernels for CCA: causal (optionally sliding-window) GQA softmax attention.

CCA attends in its compressed space with ordinary softmax attention, so any kernel works
(docs/architecture.md §3.7). These classes fill ``CCASubmodules.core_attention`` and follow Megatron's
``CoreAttentionBuilder`` protocol: ``cls(config=, layer_number=, attn_mask_type=, attention_type=, ...)``,
``forward(q, k, v, attention_mask, attn_mask_type=None, ...)`` with q ``[s, b, heads, d]`` and k, v
``[s, b, kv_heads, d]``, returning ``[s, b, heads * d]``.

Under context parallelism the keys and values of the whole sequence are all-gathered, and each of the rank's
two chunks attends to the keys up to its own end (``context_parallel.py``).

Packed documents (``documents.py``): ``attention_mask`` is then the document ids of the whole sequence
``[S, b]``, and a query sees only the keys of its own document. Where ``packed_seq_params`` is given (on a GPU,
without CUDA graphs and context parallelism: ``documents.varlen_documents``), the documents run end to end
through variable-length flash attention, which skips the work between documents. Otherwise the queries go in
blocks of ``DOCUMENT_QUERY_BLOCK``, each against the keys up to its end with a ``[block, keys]`` mask, so that no
``[S, S]`` tensor exists; the shapes do not depend on the documents (CUDA graphs replay them).
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from .context_parallel import gather_sequence, local_chunk_ids, local_chunks
from .documents import varlen_attention

DOCUMENT_QUERY_BLOCK = 1024


@functools.cache
def _takes_gqa_flag(varlen_attn) -> bool:
    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def sliding_window_mask(q_len: int, kv_len: int, window: int, device: torch.device) -> torch.Tensor:
    """Boolean [q_len, kv_len] mask, True where query i may see key j: ``0 <= i - j < window``
    (the queries are the last ``q_len`` positions of the keys')."""
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
        cp_group = getattr(pg_collection, "cp", None)
        self.cp_group = cp_group if cp_group is not None and cp_group.size() > 1 else None

    def attend(self, q, k, v, q_documents=None, k_documents=None):
        """q ``[b, heads, Lq, d]`` at the last Lq positions of k, v ``[b, kv_heads, Lk, d]``; with packed
        documents, their document ids ``[b, Lq]`` and ``[b, Lk]``."""
        q_len, kv_len = q.shape[2], k.shape[2]
        gqa = k.shape[1] != q.shape[1]
        if q_documents is not None:
            return self.attend_documents(q, k, v, q_documents, k_documents)
        if self.window is not None:
            mask = sliding_window_mask(q_len, kv_len, self.window, q.device)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale, enable_gqa=gqa)
        if q_len == kv_len:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=gqa)
        from torch.nn.attention.bias import causal_lower_right  # here: it imports dynamo, 0.5 s of a start

        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q_len, kv_len),
                                              scale=self.softmax_scale, enable_gqa=gqa)

    def attend_documents(self, q, k, v, q_documents, k_documents):
        """:meth:`attend` within documents, a block of queries at a time (see the module docstring)."""
        q_len, kv_len = q.shape[2], k.shape[2]
        outs = []
        for start in range(0, q_len, DOCUMENT_QUERY_BLOCK):
            end = min(start + DOCUMENT_QUERY_BLOCK, q_len)
            key_end = kv_len - q_len + end  # the block's last query sits at key key_end - 1
            key_start = 0 if self.window is None else max(0, key_end - (end - start) - self.window + 1)
            keys = slice(key_start, key_end)
            mask = sliding_window_mask(end - start, key_end - key_start, self.window or key_end, q.device)
            mask = mask & (q_documents[:, start:end, None] == k_documents[:, None, keys])
            outs.append(F.scaled_dot_product_attention(
                q[:, :, start:end], k[:, :, keys], v[:, :, keys], attn_mask=mask[:, None], scale=self.softmax_scale,
                enable_gqa=k.shape[1] != q.shape[1]))
        return torch.cat(outs, dim=2)

    def attend_varlen(self, q, k, v, bounds):
        """q ``[s, b, heads, d]``, k, v ``[s, b, kv_heads, d]`` as the documents of ``bounds`` laid end to end,
        row after row -> ``[s, b, heads * d]``."""
        s, b, heads, d = q.shape
        q, k, v = (t.transpose(0, 1).reshape(b * s, t.shape[2], d) for t in (q, k, v))
        # Flash attention reads each group's keys for its query heads; newer torch asks for the flag, torch 2.11
        # takes grouped keys as they are (checked on the GPU against repeated keys: identical, 14% faster).
        varlen_attn = varlen_attention()
        gqa = {"enable_gqa": True} if k.shape[1] != heads and _takes_gqa_flag(varlen_attn) else {}
        window = (-1 if self.window is None else self.window - 1, 0)  # keys back, keys ahead: causal
        out = varlen_attn(q, k, v, bounds.cu_seqlens_q, bounds.cu_seqlens_kv, bounds.max_seqlen_q,
                          bounds.max_seqlen_kv, scale=self.softmax_scale, window_size=window, **gqa)
        return out.view(b, s, heads * d).transpose(0, 1)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        s, b, heads, d = query.shape
        if packed_seq_params is not None and self.cp_group is None:
            return self.attend_varlen(query, key, value, packed_seq_params)
        documents = None if attention_mask is None else attention_mask.t()  # [b, S]
        if self.cp_group is None:
            out = self.attend(*(t.permute(1, 2, 0, 3) for t in (query, key, value)), documents, documents)
            return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)
        key, value = (gather_sequence(t, self.cp_group).permute(1, 2, 0, 3) for t in (key, value))
        local_documents = None if documents is None else local_chunks(attention_mask, self.cp_group).t()
        chunk = s // 2
        outs = []
        for index, (q, chunk_id) in enumerate(zip(query.split(chunk), local_chunk_ids(self.cp_group), strict=True)):
            end = (chunk_id + 1) * chunk  # the chunk's queries are the last positions of keys[:end]
            start = 0 if self.window is None else max(0, end - chunk - self.window + 1)
            q_documents = k_documents = None
            if documents is not None:
                q_documents = local_documents[:, index * chunk:(index + 1) * chunk]
                k_documents = documents[:, start:end]
            outs.append(self.attend(q.permute(1, 2, 0, 3), key[:, :, start:end], value[:, :, start:end],
                                    q_documents, k_documents))
        return torch.cat(outs, dim=2).permute(2, 0, 1, 3).reshape(s, b, heads * d)
