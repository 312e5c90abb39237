"""Packed documents: where each document of a training sequence starts, from the batch's position ids.

Megatron packs documents back to back; with ``--reset-position-ids`` its data loader restarts the position ids
at 0 after every EOD token, so a document starts wherever the position id is 0 (and at the sequence start).
ZAYA1 mixes tokens in four places, and each stops at a document's first token:

* attention: a query sees the keys of its own document only (``document_ids``);
* the q‖k convolutions and the value time-delay: a token reads only the earlier tokens of its document
  (``tokens_before``), as if the document were alone with zeros before it;
* RoPE: the restarted position ids.

The model hands the layers one tensor, the position ids of the whole sequence ``[S, b]`` (gathered over context
parallel ranks), in the ``attention_mask`` slot of Megatron's layer signature; every layer derives the rest. It
is data, not shape: CUDA graphs replay it like the RoPE tables. No [S, S] mask is built anywhere.

On a GPU, without CUDA graphs and context parallelism, attention runs as variable-length flash attention over
the documents laid end to end (``varlen_documents``: their offsets, read to the host once per batch).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch.utils.weak import WeakIdKeyDictionary

from .context_parallel import gather_sequence, local_chunks


def sequence_positions(position_ids: torch.Tensor, cp_group) -> torch.Tensor:
    """This rank's position ids ``[b, s]`` -> those of the whole sequence ``[S, b]`` (CP ranks hold chunks)."""
    positions = position_ids.t().contiguous()
    if cp_group is None or cp_group.size() == 1:
        return positions
    return gather_sequence(positions, cp_group)


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """``[S, b]`` position ids -> ``[S, b]`` ids that differ between documents (count of starts so far).

    The scans run along each row's own memory ([b, S]): a scan over the outer dimension of [S, b] has only b-way
    parallelism and takes ~0.4 ms at S = 4096 on an H200."""
    return torch.cumsum(positions.t().contiguous() == 0, dim=1).t()


def tokens_before(positions: torch.Tensor, cp_group=None) -> torch.Tensor:
    """``[S, b]`` position ids of the whole sequence -> ``[s, b]`` for this rank's tokens: how many earlier
    tokens of its document each token has (the tokens before the sequence start count as another document)."""
    rows = positions.t().contiguous()  # [b, S]: the scan along memory (see document_ids)
    index = torch.arange(rows.shape[1], device=rows.device, dtype=torch.int32).expand_as(rows)  # the kernels' type
    start = torch.cummax(torch.where(rows == 0, index, 0), dim=1).values
    before = (index - start).t().contiguous()
    if cp_group is None or cp_group.size() == 1:
        return before
    return local_chunks(before, cp_group)


def rotary_table(inv_freq: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """RoPE angles ``[s, b, 1, rot]`` (NeoX layout, as Megatron's ``RotaryEmbedding``) at position ids ``[b, s]``."""
    angles = position_ids.t()[..., None].to(inv_freq.dtype) * inv_freq.to(position_ids.device)
    return torch.cat([angles, angles], dim=-1)[:, :, None, :]


@functools.cache
def varlen_attention():
    """torch's variable-length attention (``torch.nn.attention.varlen.varlen_attn``), or None where torch has none.
    Imported when first asked for on a GPU: the module imports dynamo, 0.45 s of every CPU process's start."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn

_VARLEN = WeakIdKeyDictionary()  # positions tensor -> its VarlenDocuments


class VarlenDocuments(NamedTuple):
    """What every layer of a batch needs for variable-length attention, computed once per positions tensor."""

    bounds: PackedSeqParams  # the documents laid end to end, row after row
    tokens_before: torch.Tensor  # ``tokens_before(positions)``


def varlen_documents(positions: torch.Tensor, cp_group=None) -> VarlenDocuments | None:
    """The documents of ``[S, b]`` position ids laid end to end, row after row, as Megatron's
    ``PackedSeqParams`` (``cu_seqlens_q/kv`` int32 offsets, ``max_seqlen_q/kv``), with ``tokens_before``; or None
    where variable-length attention does not run: on CPU, under context parallelism or graph capture (its shapes
    follow the data).

    Every layer of a batch is handed the same positions tensor, so the one host read and the scans are cached on
    it: the caller must not change a positions tensor in place (CUDA graphs' static inputs do; they never come
    here).
    """
    if (not positions.is_cuda or torch.cuda.is_current_stream_capturing()
            or (cp_group is not None and cp_group.size() > 1) or varlen_attention() is None):
        return None
    cached = _VARLEN.get(positions)
    if cached is None:
        starts = (positions.t() == 0).flatten()
        starts[::positions.shape[0]] = True  # every row starts a document
        offsets = torch.cat([starts.nonzero().flatten(), starts.new_tensor([starts.numel()], dtype=torch.long)])
        longest = int((offsets[1:] - offsets[:-1]).max())
        offsets = offsets.to(torch.int32)
        bounds = PackedSeqParams(qkv_format="thd", cu_seqlens_q=offsets, cu_seqlens_kv=offsets,
                                 max_seqlen_q=longest, max_seqlen_kv=longest)
        cached = _VARLEN[positions] = VarlenDocuments(bounds, tokens_before(positions))
    return cached
