"""Saves through a strategy that keeps the first save's plan (``--ckpt-assume-constant-structure``, which
``--async-save`` implies), on one and two gloo ranks: a save whose structure changed, on one rank or on all, is
planned afresh and validated (``checkpointing.replan_on_new_structure``), an unchanged one is not validated again,
also on one rank (``checkpointing.validate_once_without_data_parallelism``), and every save loads back as it was
saved, each item's shard found by its offset (``checkpointing.shard_lookup_by_offset``), each layout of shards
checked for overlaps once (``checkpointing.shard_overlap_checked_once``)."""

from __future__ import annotations

import pytest
import torch
from gloo import run_ranks

# Per save: the shared tensor's elements per rank, and whether rank 1 also saves a tensor of its own.
SAVES = [(64, False), (64, False), (64, True), (96, True), (96, True)]


def _state(rank, world, save, fill):
    from megatron.core.dist_checkpointing import ShardedTensor

    per_rank, own = SAVES[save]
    sharded = torch.arange(per_rank, dtype=torch.float32) + 1000 * rank + 10 * save
    state = {"sharded": ShardedTensor.from_rank_offsets("sharded", sharded, (0, rank, world)),
             "replicated": ShardedTensor.from_rank_offsets("replicated", torch.linspace(save, 1, 32), replica_id=rank)}
    if own and rank == 1:  # a tensor only rank 1 holds: the other rank's structure is unchanged
        state["rank_1_only"] = ShardedTensor.from_rank_offsets("rank_1_only", torch.full((8,), 3.0 + save))
    if not fill:
        for value in state.values():
            value.data = torch.zeros_like(value.data)
    return state


def _saves(rank, world, root):
    """The saves of ``SAVES`` through one caching strategy, as Megatron's ``save_checkpoint`` makes them (the
    sharding validated only at the first); per save, the sharding validations run and the tensors loaded back."""
    from pathlib import Path

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import state_dict_utils
    from megatron.core.dist_checkpointing.strategies import fully_parallel
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from megatron_zaya.patches import apply_patches

    apply_patches("cpu,checkpointing.replan_on_new_structure,checkpointing.validate_once_without_data_parallelism,"
                  "checkpointing.shard_lookup_by_offset,checkpointing.shard_overlap_checked_once")
    validations = []
    for module in (state_dict_utils, fully_parallel):
        original = module.validate_sharding_integrity
        module.validate_sharding_integrity = (
            lambda *a, original=original, **k: validations.append(1) or original(*a, **k))
    strategy = fully_parallel.FullyParallelSaveStrategyWrapper(
        TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True), do_cache_distribution=True)
    results = []
    for save in range(len(SAVES)):
        directory = Path(root) / str(save)
        directory.mkdir(parents=True, exist_ok=True)
        before = len(validations)
        dist_checkpointing.save(_state(rank, world, save, fill=True), directory, strategy,
                                validate_access_integrity=save == 0)
        loaded = dist_checkpointing.load(_state(rank, world, save, fill=False), directory)
        results.append((len(validations) - before, {key: value.clone() for key, value in loaded.items()}))
    return results


@pytest.mark.parametrize("world, validations", [(2, [2, 0, 2, 2, 0]), (1, [2, 0, 0, 2, 0])])
def test_a_save_whose_structure_changed_is_planned_afresh_on_every_rank(tmp_path, world, validations):
    """The second save reuses the plan (no validation); on two ranks the third, where only rank 1 saves one more
    tensor, is validated on both; the fourth, where the shared tensor grows, is validated, and the fifth reuses the
    new plan. Every save loads back equal to the tensors saved."""
    for rank, saves in enumerate(run_ranks(_saves, world, tmp_path, str(tmp_path / "ckpt"))):
        assert [validated for validated, _ in saves] == validations, (rank, saves)
        for save, (_, loaded) in enumerate(saves):
            expected = {key: value.data for key, value in _state(rank, world, save, fill=True).items()}
            assert sorted(loaded) == sorted(expected), (rank, save)
            for key, value in expected.items():
                torch.testing.assert_close(loaded[key], value, rtol=0, atol=0)


def _lookups(rank, world):
    """Each shard of a 40-shard torch ``ShardedTensor`` looked up by offset through the patch and through torch's
    own scan, and the error for an offset no shard has."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards
    from torch.distributed.checkpoint import utils
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from megatron_zaya.patches import apply_patches

    shards = [Shard(torch.full((2, 3), float(i)), ShardMetadata([2 * i, 0], [2, 3], "rank:0/cpu")) for i in range(40)]
    tensor, scan = init_from_local_shards(shards, 80, 3), utils._find_shard
    apply_patches("cpu,checkpointing.shard_lookup_by_offset")
    same = [utils._find_shard(tensor, MetadataIndex("t", torch.Size([2 * i, 0]))) is scan(
        tensor, MetadataIndex("t", torch.Size([2 * i, 0]))) for i in reversed(range(40))]
    try:
        utils._find_shard(tensor, MetadataIndex("t", torch.Size([1, 0])))
    except ValueError as error:
        return same, str(error)
    return same, None


def test_a_shard_is_found_by_its_offset_as_torch_finds_it(tmp_path):
    (same, missing), = run_ranks(_lookups, 1, tmp_path)
    assert same == [True] * 40
    assert missing == "Could not find shard at 'torch.Size([1, 0])' for FQN: 't'", missing


def _overlap_checks(rank, world):
    """torch's pairwise overlap search run by three checks of one 4 x 4 grid of shards, and for a layout with two
    overlapping shards, checked twice: the searches, and each check's error."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharding_spec import _internals
    from torch.distributed._shard.sharding_spec import api as spec_api

    from megatron_zaya.patches import apply_patches

    apply_patches("cpu,checkpointing.shard_overlap_checked_once")
    searches, search = [], _internals._find_nd_overlapping_shards
    _internals._find_nd_overlapping_shards = lambda *a: searches.append(1) or search(*a)
    grid = [ShardMetadata([2 * i, 3 * j], [2, 3], "rank:0/cpu") for i in range(4) for j in range(4)]
    for _ in range(3):
        spec_api.validate_non_overlapping_shards_metadata(list(grid))
    on_grid = len(searches)
    errors = []
    for _ in range(2):
        try:
            spec_api.validate_non_overlapping_shards_metadata(grid + [ShardMetadata([1, 1], [2, 3], "rank:0/cpu")])
        except ValueError as error:
            errors.append(str(error).split(" overlap")[0])
    return on_grid, len(searches) - on_grid, errors


def test_a_layout_of_shards_is_checked_for_overlaps_once_and_an_overlap_always_fails(tmp_path):
    (on_grid, on_overlap, errors), = run_ranks(_overlap_checks, 1, tmp_path)
    assert (on_grid, on_overlap) == (1, 2)
    assert len(errors) == 2 and all(error.startswith("Shards ShardMetadata(") for error in errors), errors
