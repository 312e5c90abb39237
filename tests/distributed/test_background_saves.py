"""Background checkpoint saves on two gloo ranks. A background save holds the state of its step while training
changes the tensors before the writer has written them, whatever part of them the copy budget lets it copy; the
writer checksums its files as it writes them, never reading them back."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch
from gloo import run_ranks


def _save_change_and_load(rank, world, root, budget):
    """A ``torch_dist`` background save of a sharded and a replicated tensor through ``background_request``
    with a copy budget of ``budget`` bytes, run in the writer's order (the preload while training waits, then
    the write) with the training tensors changed in between; returns (how many tensors the preload copies to
    host memory while training waits, the values loaded back, the values at the save, the writers' checksum
    records, how many files the writer read back to checksum them)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from megatron_zaya.patches import apply_patches
    from megatron_zaya.checkpoint import tiers as checkpoint_tiers

    from megatron_zaya.checkpoint import format as checkpoint_format

    apply_patches("cpu,checkpointing.checksums_while_writing")

    def state(fill):
        sharded = torch.arange(64, dtype=torch.float32) + 1000 * rank if fill else torch.zeros(64)
        replicated = torch.linspace(0, 1, 256, dtype=torch.float32) if fill else torch.zeros(256)
        return {"sharded": ShardedTensor.from_rank_offsets("sharded", sharded, (0, rank, world)),
                "replicated": ShardedTensor.from_rank_offsets("replicated", replicated, replica_id=rank)}

    training = state(fill=True)
    at_save = {key: value.data.clone() for key, value in training.items()}
    Path(root).mkdir(exist_ok=True)
    request = dist_checkpointing.save(training, root, TorchDistSaveShardedStrategy("torch_dist", 1),
                                      async_sharded_save=True, async_strategy="mcore")
    checkpoint_tiers.copy_budget = lambda: budget
    request = checkpoint_tiers.background_request(request)
    args = list(request.async_fn_args)
    args[1] = request.preload_fn()
    for value in training.values():
        value.data.mul_(-3).add_(7)  # the next optimizer steps
    hashed, file_crcs = [], checkpoint_format.file_crcs
    checkpoint_format.file_crcs = lambda paths: hashed.extend(paths) or file_crcs(paths)
    request.async_fn(*args, **request.async_fn_kwargs)
    for finalize in request.finalize_fns:
        finalize()
    loaded = dist_checkpointing.load(state(fill=False), root)
    records = {p.name: checkpoint_format.recorded_files(root, p.name)
               for p in Path(root).glob(".zaya_checksums.json.rank-*")}
    return len(request.preload_fn.args[1]), loaded, at_save, records, len(hashed)


# Rank 0 writes its 256 B shard and the 1 KiB replicated tensor, rank 1 its shard: 300 B copy only the shards.
@pytest.mark.parametrize(("budget", "waits"), [(float("inf"), [0, 0]), (300, [1, 0])],
                         ids=["all-copied", "some-copied"])
def test_a_background_save_writes_the_state_of_its_step_while_training_changes_it(tmp_path, budget, waits):
    for rank, (waited_for, loaded, at_save, records, hashed) in enumerate(
            run_ranks(_save_change_and_load, 2, tmp_path, str(tmp_path / "ckpt"), budget)):
        assert waited_for == waits[rank], (rank, waited_for)
        for key, value in at_save.items():
            torch.testing.assert_close(loaded[key], value, rtol=0, atol=0)
        assert sorted(records) == [f".zaya_checksums.json.rank-{r:05d}" for r in range(2)], records
        assert hashed == 0  # checksummed as written, never read back
    for name, table in records.items():  # what the writers recorded is what the files hold
        assert table and all([len(data := (tmp_path / "ckpt" / file).read_bytes()), zlib.crc32(data)] == size_crc
                             for file, size_crc in table.items()), (name, table)
