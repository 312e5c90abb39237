"""ZeRO-1 for ``--optimizer zaya_muon --use-distributed-optimizer``: Megatron's DDP buckets, laid out by owner.

Megatron's DDP with ``use_distributed_optimizer`` reduce-scatters each gradient bucket and all-gathers each
parameter bucket, rank r keeping the r-th equal shard of every bucket (overlapped with backward / forward
under ``--overlap-grad-reduce`` / ``--overlap-param-gather``). Megatron-Core 0.19 lets the optimizer choose
the layout of those buckets (``FullParamLayout``) and routes matrices tagged
``is_managed_by_layer_wise_optimizer`` to buffers of their own. Here:

* ``tag_muon_params``: the Muon matrices of ``roles`` go to those buffers (``zaya_muon_layout`` records their
  matrix layout for the FLOP count);
* ``compute_full_param_layout``: the Muon buffers are cut into buckets in backward order, as Megatron cuts
  them but grown (up to 4×) until the shards are even; within each bucket, every matrix goes whole into the
  shard of the rank that runs its Newton–Schulz, chosen by LPT over Newton–Schulz FLOPs with loads carried
  from bucket to bucket (``plan.lpt_owners``), and shards are padded to the longest. The reduce-scatter then
  leaves each matrix's summed gradient on its owner and the all-gather sends the owner's updated bf16 weight
  to every rank. Other parameters (AdamW's) get Megatron's ``DistributedOptimizer`` layout and optimizer;
* ``owners``: each Muon parameter's owner, read back from the DDP-wrapped model chunks.

Between steps each rank then holds the bf16 weights and the gradient buffer of the whole model, and fp32
master weights and momentum (or AdamW's master and moments) of its shard only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch

from .plan import build_items, lpt_owners
from .roles import MUON, classify_named_parameters

#: Attribute set on every trainable parameter by ``tag_muon_params``: its MatrixLayout, or None (AdamW).
LAYOUT_ATTR = "zaya_muon_layout"
_PADDING_FLOOR = 0.9  # as Megatron's layer-wise layout: a bucket holds >= 0.9 · dp · its largest matrix
_MAX_PADDING, _MAX_GROWTH = 0.01, 4  # a bucket grows past its size until padded by at most 1%, up to 4x


def tag_muon_params(model_chunks: Iterable[torch.nn.Module], split_gate_up: bool = False) -> None:
    """Route ZayaMuon's matrices to Megatron's layer-wise (owner-aligned) buffers, the rest to the byte-level ones."""
    for chunk in model_chunks:
        roles = classify_named_parameters(chunk.named_parameters(), split_gate_up=split_gate_up)
        for param, (_, role) in roles.items():
            param.is_managed_by_layer_wise_optimizer = role.optimizer == MUON
            setattr(param, LAYOUT_ATTR, role.layout)


def is_tagged(params: Iterable[torch.Tensor]) -> bool:
    return any(hasattr(p, LAYOUT_ATTR) for p in params)


def compute_full_param_layout(params: list[torch.nn.Parameter], bucket_size: Optional[int],
                              data_parallel_world_size: int, ddp_config,
                              expert_data_parallel_world_size: Optional[int] = None):
    """``LayerWiseDistributedOptimizer.compute_full_param_layout`` with owner-aligned Muon buffers (see module)."""
    from megatron.core.distributed.param_and_grad_buffer import group_params_for_buffers
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.param_layout import FullParamLayout

    layouts = {}
    for key, (group, indices) in group_params_for_buffers(params, ddp_config.grad_reduce_in_fp32).items():
        dp_size = data_parallel_world_size
        if key.is_expert_parallel and expert_data_parallel_world_size is not None:
            dp_size = expert_data_parallel_world_size
        if key.is_managed_by_layer_wise_optimizer:
            layouts[key] = owner_aligned_layout(group, bucket_size, dp_size, ddp_config, indices)
        else:
            layouts[key] = DistributedOptimizer._compute_per_buffer_param_layout(group, bucket_size, dp_size,
                                                                                 ddp_config, indices)
    return FullParamLayout(layouts=layouts)


def newton_schulz_flops(params: list[torch.nn.Parameter]) -> list[float]:
    """Newton–Schulz FLOPs of each parameter per iteration (global shapes: TP shards are gathered first)."""
    from megatron.core import parallel_state

    tp, expert_tp = 1, 1
    if parallel_state.model_parallel_is_initialized():
        tp = parallel_state.get_tensor_model_parallel_world_size()
        expert_tp = parallel_state.get_expert_tensor_parallel_world_size()
    flops = []
    for param in params:
        items = build_items([{"params": [param]}], {param: getattr(param, LAYOUT_ATTR)}, tp, expert_tp)
        flops.append(sum(item.flops(1) for item in items))
    return flops


def owner_aligned_layout(params: list[torch.nn.Parameter], bucket_size: Optional[int], dp_size: int, ddp_config,
                         param_indices: Optional[list[int]] = None):
    """A ``PerBufferParamLayout`` whose bucket shards hold whole matrices, each in its owner's shard."""
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
    from megatron.core.optimizer.param_layout import PerBufferParamLayout, pad_param_start, pad_to_divisor

    divisor = LayerWiseDistributedOptimizer._shard_divisor(dp_size, ddp_config)
    layout = PerBufferParamLayout(param_indices=list(param_indices or []), num_optimizer_shards=dp_size)
    load = [0.0] * dp_size  # Newton–Schulz FLOPs per rank so far

    def pack(chunk: list[torch.nn.Parameter]) -> tuple[list[float], list[list[torch.nn.Parameter]], int]:
        """(loads after, params per shard, padded shard size) of ``chunk`` as one bucket."""
        after = list(load)
        placed: list[list[torch.nn.Parameter]] = [[] for _ in range(dp_size)]
        for param, owner in zip(chunk, lpt_owners(newton_schulz_flops(chunk), after)):
            placed[owner].append(param)
        cursors = [0] * dp_size
        for rank, shard_params in enumerate(placed):
            for param in shard_params:
                cursors[rank] = pad_param_start(cursors[rank]) + param.numel()
        return after, placed, pad_to_divisor(max(cursors), divisor)

    def emit(chunk: list[torch.nn.Parameter], packed) -> None:
        after, placed, shard = packed
        load[:] = after
        start, bucket = layout.bucket_indices[-1][1] if layout.bucket_indices else 0, len(layout.bucket_indices)
        for rank, shard_params in enumerate(placed):
            cursor = start + rank * shard
            for param in shard_params:
                cursor = pad_param_start(cursor)
                layout.param_index_map[param] = (cursor, cursor + param.numel(), bucket)
                cursor += param.numel()
        layout.bucket_indices.append((start, start + dp_size * shard))
        layout.per_bucket_numel_unpadded.append(sum(p.numel() for p in chunk))

    # Buckets in backward order (each bucket's reduce-scatter starts as soon as its gradients are done). A bucket
    # closes at ``bucket_size`` elements (and at least 0.9 · dp · its largest matrix) once its shards are even to
    # within ``_MAX_PADDING``, or at ``_MAX_GROWTH`` times that size whatever its padding.
    chunk, numel, largest = [], 0, 0
    for param in reversed(params):
        chunk.append(param)
        numel, largest = numel + param.numel(), max(largest, param.numel())
        target = max(bucket_size, int(dp_size * largest * _PADDING_FLOOR)) if bucket_size is not None else None
        if target is not None and numel >= target:
            packed = pack(chunk)
            if dp_size * packed[2] <= numel * (1 + _MAX_PADDING) or numel >= _MAX_GROWTH * target:
                emit(chunk, packed)
                chunk, numel, largest = [], 0, 0
    if chunk:
        emit(chunk, pack(chunk))
    return layout


def owners(model_chunks: Iterable) -> dict[torch.nn.Parameter, int]:
    """``{Muon parameter: owner}`` (rank in its data-parallel group) from the DDP chunks' owner-aligned layouts."""
    found = {}
    for chunk in model_chunks:
        full = getattr(chunk, "full_param_layout", None)
        for key, layout in (full.layouts.items() if full is not None else ()):
            if not key.is_managed_by_layer_wise_optimizer:
                continue
            for param, (start, _, bucket) in layout.param_index_map.items():
                first, last = layout.bucket_indices[bucket]
                found[param] = (start - first) // ((last - first) // layout.num_optimizer_shards)
    return found
