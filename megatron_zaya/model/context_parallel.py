"""Context parallelism for CCA: the halos its convolutions need, and the keys and values of the whole sequence.

Megatron's load-balanced split (``get_batch_on_this_cp_rank``) cuts a sequence into 2·cp equal chunks and gives
CP rank r chunks r and 2·cp-1-r, concatenated: the early chunk's light causal attention pairs with the late
chunk's heavy one. ZAYA1 mixes positions in three places, and each needs data of other chunks:

* the causal q‖k convolutions read the last ``cca_time0 + cca_time1 - 2`` pre-conv positions before a chunk;
* the value time-delay reads one token before a chunk;
* attention reads every earlier key and value. CCA's keys and values are 8x compressed (2 KV heads of 128 for
  a 2048-wide model), so, as ZAYA1 did, each rank all-gathers them instead of passing a ring of partial results.

Both exchanges are all-gathers with a reduce-scatter backward (Megatron's sequence-parallel mapping over the
CP group): every rank's chunks feed others' outputs, and their gradients come back summed. The ``cca_sublayer``
op, which writes its own backward, runs the halos' exchange and its reverse as :class:`PrecedingRows`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region


def local_chunk_ids(cp_group) -> tuple[int, int]:
    """The global chunk indices of this rank's two chunks, in local order."""
    rank, size = cp_group.rank(), cp_group.size()
    return rank, 2 * size - 1 - rank


def _in_sequence_order(pairs: torch.Tensor) -> torch.Tensor:
    """``[cp, 2, ...]``, each rank's pair of chunks in rank order, -> ``[2·cp, ...]`` in global chunk order.

    Rank r's first chunk is chunk r, its second chunk 2·cp-1-r, so the first chunks in rank order followed by the
    second chunks in reverse rank order are the sequence.
    """
    return torch.cat([pairs[:, 0], pairs[:, 1].flip(0)])


def _in_rank_order(chunks: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_in_sequence_order`: ``[2·cp, ...]`` -> ``[cp, 2, ...]``."""
    size = chunks.shape[0] // 2
    return torch.stack([chunks[:size], chunks[size:].flip(0)], dim=1)


def _all_gather_chunks(chunks: torch.Tensor, cp_group) -> torch.Tensor:
    """``[2, ...]`` per rank -> ``[2·cp, ...]`` in global chunk order (differentiable)."""
    gathered = gather_from_sequence_parallel_region(chunks.contiguous(), tensor_parallel_output_grad=True,
                                                    group=cp_group)
    return _in_sequence_order(gathered.view(cp_group.size(), 2, *chunks.shape[1:]))


def gather_sequence(local: torch.Tensor, cp_group) -> torch.Tensor:
    """This rank's two chunks ``[2L, ...]`` -> the whole sequence ``[2·cp·L, ...]`` in order."""
    chunks = local.view(2, local.shape[0] // 2, *local.shape[1:])
    return _all_gather_chunks(chunks, cp_group).flatten(0, 1)


def _tails(locals_and_rows: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """``[2, W]``: the last ``rows`` positions of each of this rank's chunks of every ``local [2L, b, C]``, side by
    side (W: their sizes summed)."""
    tails = []
    for local, rows in locals_and_rows:
        chunks = local.view(2, local.shape[0] // 2, *local.shape[1:])
        if rows > chunks.shape[1]:
            raise ValueError(f"context parallelism: a chunk of {chunks.shape[1]} tokens is shorter than the "
                             f"{rows}-token halo of the CCA convolutions; use a longer sequence or a smaller CP size")
        tails.append(chunks[:, chunks.shape[1] - rows:].flatten(1))
    return torch.cat(tails, dim=1)


def _preceding(every_tail: torch.Tensor, cp_group) -> torch.Tensor:
    """Every chunk's tail ``[2·cp, W]`` in sequence order -> ``[2, W]``, the tail of the chunk before each of this
    rank's chunks (zeros before the first)."""
    before_first = torch.zeros_like(every_tail[:1])
    preceding = torch.cat([before_first, every_tail[:-1]])  # row g: the tail of chunk g - 1
    return torch.stack([preceding[i] for i in local_chunk_ids(cp_group)])


def _parts(rows_side_by_side: torch.Tensor, shapes_and_rows: list[tuple[torch.Size, int]]) -> list[torch.Tensor]:
    """``[2, W]`` -> ``[2, rows, b, C]`` for each local's ``(shape [2L, b, C], rows)``."""
    widths = [rows * shape[1:].numel() for shape, rows in shapes_and_rows]
    return [part.view(2, rows, *shape[1:])
            for part, (shape, rows) in zip(rows_side_by_side.split(widths, dim=1), shapes_and_rows, strict=True)]


def preceding_rows(locals_and_rows: list[tuple[torch.Tensor, int]], cp_group) -> list[torch.Tensor]:
    """For each ``(local [2L, b, C], rows)``: ``[2, rows, b, C]``, the last ``rows`` positions before each of
    this rank's chunks in the full sequence (zeros before the first chunk). One all-gather for all of them."""
    every_tail = _all_gather_chunks(_tails(locals_and_rows), cp_group)  # [2·cp, W]
    return _parts(_preceding(every_tail, cp_group), [(local.shape, rows) for local, rows in locals_and_rows])


class PrecedingRows:
    """:func:`preceding_rows` for an op that writes its own backward, off autograd: the same all-gather, its rows in
    :attr:`preceding`, and :meth:`backward`, the reduce-scatter that autograd runs for it op by op.

    A chunk's tail gets its gradient from the one rank whose chunk follows it (none for the sequence's last
    chunk): the reduce-scatter sends it back to the rank that holds the tail, the others adding zeros."""

    def __init__(self, locals_and_rows: list[tuple[torch.Tensor, int]], cp_group):
        tails = _tails(locals_and_rows)
        gathered = tails.new_empty((cp_group.size() * 2, tails.shape[1]))
        dist.all_gather_into_tensor(gathered, tails, group=cp_group)
        every_tail = _in_sequence_order(gathered.view(cp_group.size(), *tails.shape))
        self.cp_group, self.shapes_and_rows = cp_group, [(local.shape, rows) for local, rows in locals_and_rows]
        self.preceding = _parts(_preceding(every_tail, cp_group), self.shapes_and_rows)

    def backward(self, grads: list[torch.Tensor | None], into: list[torch.Tensor]) -> None:
        """Adds the gradient of each of :attr:`preceding` (``grads``; None for zeros) into that of the local it came
        from, on the rank that holds it: ``into``, the locals' gradients (each like its local; in place)."""
        grad_rows = torch.cat([torch.zeros_like(rows).flatten(1) if grad is None else grad.reshape(2, -1)
                               for grad, rows in zip(grads, self.preceding, strict=True)], dim=1)
        grad_every_tail = grad_rows.new_zeros((2 * self.cp_group.size(), grad_rows.shape[1]))
        for grad, chunk in zip(grad_rows, local_chunk_ids(self.cp_group)):
            if chunk > 0:  # the first chunk's rows are zeros, from no rank
                grad_every_tail[chunk - 1] = grad
        grad_tails = torch.empty_like(grad_rows)
        dist.reduce_scatter_tensor(grad_tails, _in_rank_order(grad_every_tail).flatten(0, 1), group=self.cp_group)
        for grad_tail, grad in zip(_parts(grad_tails, self.shapes_and_rows), into, strict=True):
            chunks = grad.view(2, grad.shape[0] // 2, *grad.shape[1:])
            chunks[:, chunks.shape[1] - grad_tail.shape[1]:].add_(grad_tail)


def local_chunks(full: torch.Tensor, cp_group) -> torch.Tensor:
    """The inverse of :func:`gather_sequence` (no communication): the whole sequence ``[2·cp·L, ...]`` -> this
    rank's two chunks ``[2L, ...]``."""
    chunks = full.view(2 * cp_group.size(), full.shape[0] // (2 * cp_group.size()), *full.shape[1:])
    return chunks[list(local_chunk_ids(cp_group))].flatten(0, 1)
