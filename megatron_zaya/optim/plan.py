"""Who orthogonalises what: Muon's Newton–Schulz work cut into items and spread over data-parallel ranks.

An *item* is one slice of one Muon parameter: the whole parameter for a 2-D weight, one expert for a
grouped 3-D ``[E_local, rows, cols]`` weight. Its momentum lives only on its owner, which runs its
Newton–Schulz (on the full matrix: TP shards are gathered first) and sends the result to every rank.
A 2-D parameter is one item (linear_v's two halves and fc1's gate/up blocks share an owner), so
momentum ownership maps onto whole parameters or whole expert slices in checkpoints.

Owners are picked by longest-processing-time-first over the Newton–Schulz FLOPs, which every rank of a
data-parallel group computes identically from global shapes: no communication needed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import torch

from .roles import MatrixLayout


@dataclasses.dataclass(frozen=True)
class WorkItem:
    """One slice of one Muon parameter, addressed by position in the optimizer's param groups.

    ``local_shape`` / ``global_shape``: [rows, cols] of the slice on this rank / after the TP gather.
    ``tp_dim``: the slice dimension that is TP-sharded (None: the slice is whole on this rank).
    """

    group: int
    index: int
    slice_index: int
    layout: MatrixLayout
    local_shape: tuple[int, int]
    global_shape: tuple[int, int]
    tp_dim: int | None
    owner: int = 0

    @property
    def numel(self) -> int:
        return self.local_shape[0] * self.local_shape[1]

    @property
    def block_shape(self) -> tuple[int, int]:
        """Global [rows, cols] of each of the ``layout.row_blocks`` matrices in this slice."""
        return self.global_shape[0] // self.layout.row_blocks, self.global_shape[1]

    def update_scale(self, update_rms: float) -> float:
        """``update_rms · √max(rows, cols)``: an orthogonal update then has AdamW's RMS (Liu et al. 2025)."""
        return update_rms * math.sqrt(max(self.block_shape))

    def flops(self, steps: int) -> float:
        """Newton–Schulz FLOPs: per step and block, X·Xᵀ (2m²n), A·A (2m³), B·X (2m²n) with m <= n."""
        m, n = sorted(self.block_shape)
        return steps * self.layout.row_blocks * (4.0 * m * m * n + 2.0 * m**3)


def tp_dim_of(param: torch.Tensor, tp_size: int) -> int | None:
    """The TP-sharded dimension of one slice of ``param``, from Megatron's TP attributes."""
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return None
    dim = param.partition_dim - (param.dim() - 2)
    if dim not in (0, 1):
        raise ValueError(
            f"ZayaMuon: a {param.dim()}-D parameter sharded along dim {param.partition_dim} cannot be "
            "orthogonalised per slice; grouped experts must be TP-sharded along rows or columns"
        )
    return dim


def build_items(
    param_groups: Sequence[dict],
    layouts: Mapping[torch.Tensor, MatrixLayout],
    tp_size: int,
    expert_tp_size: int,
) -> list[WorkItem]:
    """Every slice of every parameter in ``param_groups`` as a ``WorkItem`` (owner not yet assigned).

    ``tp_size`` / ``expert_tp_size``: sizes of the (expert) tensor-parallel group of the parameters.
    """
    items = []
    for g, group in enumerate(param_groups):
        for i, param in enumerate(group["params"]):
            layout = layouts.get(param) or _default_layout(param)
            if param.dim() not in (2, 3) or layout.slices != (param.shape[0] if param.dim() == 3 else 1):
                raise ValueError(f"ZayaMuon: layout {layout} does not fit a parameter of shape {tuple(param.shape)}")
            size = expert_tp_size if layout.expert else tp_size
            tp_dim = tp_dim_of(param, size)
            _check_stride(param, layout, tp_dim)
            local = tuple(param.shape[-2:])
            global_ = tuple(n * size if d == tp_dim else n for d, n in enumerate(local))
            shards = size if layout.blocks_per_tp_shard and tp_dim == 0 else 1
            if global_[0] % (shards * layout.row_blocks):
                raise ValueError(
                    f"ZayaMuon: {global_[0]} rows cannot be cut into {layout.row_blocks} row blocks "
                    f"over {shards} TP shard(s) (parameter of shape {tuple(param.shape)})"
                )
            for s in range(layout.slices):
                items.append(WorkItem(g, i, s, layout, local, global_, tp_dim))
    return items


def _check_stride(param: torch.Tensor, layout: MatrixLayout, tp_dim: int | None) -> None:
    """A TP shard of stride k holds a k-way interleave of the parameter (Megatron's GLU fc1: each rank's rows of
    gate, then of up). Gathered shards are then a permutation of the matrix's rows or columns, which
    orthogonalisation commutes with, so the stride does not matter for whole matrices; row blocks must be the
    interleave's pieces (``blocks_per_tp_shard``, one block per piece)."""
    stride = getattr(param, "partition_stride", 1)
    if tp_dim is None or stride == 1 or layout.row_blocks == 1:
        return
    if not (tp_dim == 0 and layout.blocks_per_tp_shard and layout.row_blocks == stride):
        raise ValueError(f"ZayaMuon: a parameter of shape {tuple(param.shape)} TP-sharded with stride {stride} "
                         f"cannot be cut into {layout.row_blocks} row blocks; each TP shard must hold one piece of "
                         "every block (MatrixLayout.blocks_per_tp_shard)")


def _default_layout(param: torch.Tensor) -> MatrixLayout:
    if param.dim() == 2:
        return MatrixLayout()
    if param.dim() == 3:
        return MatrixLayout(slices=param.shape[0])
    raise ValueError(f"ZayaMuon orthogonalises 2-D matrices or 3-D stacks of them, got shape {tuple(param.shape)}")


def assign_owners(items: Sequence[WorkItem], dp_size: int, steps: int) -> list[WorkItem]:
    """Give each item an owner in [0, dp_size), balancing Newton–Schulz FLOPs (greedy LPT).

    Deterministic: larger items first, equal costs in model order, ties to the lower rank.
    """
    owners = lpt_owners([item.flops(steps) for item in items], [0.0] * dp_size)
    return [dataclasses.replace(item, owner=owner) for item, owner in zip(items, owners)]


def lpt_owners(costs: Sequence[float], load: list[float]) -> list[int]:
    """Owners of jobs of ``costs`` over ``len(load)`` ranks by greedy LPT, adding to ``load`` (each rank's
    running total, so that successive calls keep balancing). Larger jobs first, equal costs in order, ties
    to the lower rank."""
    owners = [0] * len(costs)
    for k in sorted(range(len(costs)), key=lambda k: -costs[k]):
        rank = min(range(len(load)), key=lambda r: (load[r], r))
        owners[k] = rank
        load[rank] += costs[k]
    return owners
