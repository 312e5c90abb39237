"""Context parallelism for CCA: the halos its convolutions need, and the keys and values of the whole sequence.

Megatron's load-balanced split (``get_batch_on_this_cp_rank``) cuts a sequence into 2·cp equal chunks and gives
CP rank r chunks r and 2·cp-1-r, concatenated: the early chunk's light causal attention pairs with the late
chunk's heavy one. ZAYA1 mixes positions in three places, and each needs data of other chunks:

* the causal q‖k convolutions read the last ``cca_time0 + cca_time1 - 2`` pre-conv positions before a chunk;
* the value time-delay reads one token before a chunk;
* attention reads every earlier key and value. CCA's keys and values are 8x compressed (2 KV heads of 128 for
  a 2048-wide model), so, as ZAYA1 did, each rank all-gathers them instead of passing a ring of partial results.

Both exchanges are all-gathers with a reduce-scatter backward (Megatron's sequence-parallel mapping over the
CP group): every rank's chunks feed others' outputs, and their gradients come back summed.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region


def local_chunk_ids(cp_group) -> tuple[int, int]:
    """The global chunk indices of this rank's two chunks, in local order."""
    rank, size = cp_group.rank(), cp_group.size()
    return rank, 2 * size - 1 - rank


def _all_gather_chunks(chunks: torch.Tensor, cp_group) -> torch.Tensor:
    """``[2, ...]`` per rank -> ``[2·cp, ...]`` in global chunk order (differentiable).

    The all-gather stacks the ranks' pairs: rank r's first chunk is chunk r, its second chunk 2·cp-1-r, so the
    first chunks in rank order followed by the second chunks in reverse rank order are the sequence.
    """
    gathered = gather_from_sequence_parallel_region(chunks.contiguous(), tensor_parallel_output_grad=True,
                                                    group=cp_group)
    pairs = gathered.view(cp_group.size(), 2, *chunks.shape[1:])
    return torch.cat([pairs[:, 0], pairs[:, 1].flip(0)])


def gather_sequence(local: torch.Tensor, cp_group) -> torch.Tensor:
    """This rank's two chunks ``[2L, ...]`` -> the whole sequence ``[2·cp·L, ...]`` in order."""
    chunks = local.view(2, local.shape[0] // 2, *local.shape[1:])
    return _all_gather_chunks(chunks, cp_group).flatten(0, 1)


def preceding_rows(locals_and_rows: list[tuple[torch.Tensor, int]], cp_group) -> list[torch.Tensor]:
    """For each ``(local [2L, b, C], rows)``: ``[2, rows, b, C]``, the last ``rows`` positions before each of
    this rank's chunks in the full sequence (zeros before the first chunk). One all-gather for all of them."""
    tails = []
    for local, rows in locals_and_rows:
        chunks = local.view(2, local.shape[0] // 2, *local.shape[1:])
        if rows > chunks.shape[1]:
            raise ValueError(f"context parallelism: a chunk of {chunks.shape[1]} tokens is shorter than the "
                             f"{rows}-token halo of the CCA convolutions; use a longer sequence or a smaller CP size")
        tails.append(chunks[:, chunks.shape[1] - rows:].flatten(1))
    widths = [tail.shape[1] for tail in tails]
    every_tail = _all_gather_chunks(torch.cat(tails, dim=1), cp_group)  # [2·cp, sum of widths]
    before_first = torch.zeros_like(every_tail[:1])
    preceding = torch.cat([before_first, every_tail[:-1]])  # row g: the tail of chunk g - 1
    previous = torch.stack([preceding[i] for i in local_chunk_ids(cp_group)])  # [2, sum of widths]
    return [part.view(2, rows, *local.shape[1:])
            for part, (local, rows) in zip(previous.split(widths, dim=1), locals_and_rows, strict=True)]


def local_chunks(full: torch.Tensor, cp_group) -> torch.Tensor:
    """The inverse of :func:`gather_sequence` (no communication): the whole sequence ``[2·cp·L, ...]`` -> this
    rank's two chunks ``[2L, ...]``."""
    chunks = full.view(2 * cp_group.size(), full.shape[0] // (2 * cp_group.size()), *full.shape[1:])
    return chunks[list(local_chunk_ids(cp_group))].flatten(0, 1)
