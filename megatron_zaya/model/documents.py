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
"""

from __future__ import annotations

import torch

from .context_parallel import gather_sequence, local_chunks


def sequence_positions(position_ids: torch.Tensor, cp_group) -> torch.Tensor:
    """This rank's position ids ``[b, s]`` -> those of the whole sequence ``[S, b]`` (CP ranks hold chunks)."""
    positions = position_ids.t().contiguous()
    if cp_group is None or cp_group.size() == 1:
        return positions
    return gather_sequence(positions, cp_group)


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """``[S, b]`` position ids -> ``[S, b]`` ids that differ between documents (count of starts so far)."""
    return torch.cumsum(positions == 0, dim=0)


def tokens_before(positions: torch.Tensor, cp_group=None) -> torch.Tensor:
    """``[S, b]`` position ids of the whole sequence -> ``[s, b]`` for this rank's tokens: how many earlier
    tokens of its document each token has (the tokens before the sequence start count as another document)."""
    index = torch.arange(positions.shape[0], device=positions.device)[:, None].expand_as(positions)
    start = torch.cummax(torch.where(positions == 0, index, 0), dim=0).values
    before = index - start
    if cp_group is None or cp_group.size() == 1:
        return before
    return local_chunks(before, cp_group)


def rotary_table(inv_freq: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """RoPE angles ``[s, b, 1, rot]`` (NeoX layout, as Megatron's ``RotaryEmbedding``) at position ids ``[b, s]``."""
    angles = position_ids.t()[..., None].to(inv_freq.dtype) * inv_freq.to(position_ids.device)
    return torch.cat([angles, angles], dim=-1)[:, :, None, :]
