"""Checkpoint saves on two gloo ranks. A background save holds the state of its step while training changes the
tensors before the writer has written them, whatever part of them the copy budget lets it copy; the writer, in a
background or a synchronous save, checksums its files as it writes them, never reading them back."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch
from gloo import run_ranks


def _state(rank, world, fill):
    """A tensor sharded over the ranks and a replicated one, filled or zeros (to load into)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    sharded = torch.arange(64, dtype=torch.float32) + 1000 * rank if fill else torch.zeros(64)
    replicated = torch.linspace(0, 1, 256, dtype=torch.float32) if fill else torch.zeros(256)
    return {"sharded": ShardedTensor.from_rank_offsets("sharded", sharded, (0, rank, world)),
            "replicated": ShardedTensor.from_rank_offsets("replicated", replicated, replica_id=rank)}


def _count_reads(checkpoint_format) -> list:
    """The paths ``format.file_crcs`` is asked to hash from now on (it reads every file it hashes)."""
    hashed, file_crcs = [], checkpoint_format.file_crcs
    checkpoint_format.file_crcs = lambda paths: hashed.extend(paths) or file_crcs(paths)
    return hashed


def _save_change_and_load(rank, world, root, budget):
    """A ``torch_dist`` background save of a sharded and a replicated tensor through ``background_request``
    with a copy budget of ``budget`` bytes, run in the writer's order (the preload while training waits, then
    the write) with the training tensors changed in between; returns (how many tensors the preload copies to
    host memory while training waits, the values loaded back, the values at the save, the writers' checksum
    records, how many files the writer read back to checksum them)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from megatron_zaya.patches import apply_patches
    from megatron_zaya.checkpoint import tiers as checkpoint_tiers

    from megatron_zaya.checkpoint import format as checkpoint_format

    apply_patches("cpu,checkpointing.checksums_while_writing")

    training = _state(rank, world, fill=True)
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
    hashed = _count_reads(checkpoint_format)
    request.async_fn(*args, **request.async_fn_kwargs)
    for finalize in request.finalize_fns:
        finalize()
    loaded = dist_checkpointing.load(_state(rank, world, fill=False), root)
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


def _save_synchronously(rank, world, root):
    """A synchronous ``torch_dist`` save of the two tensors, then rank 0's ``zaya_checksums.json`` as the tracker
    writes it; returns (the files read back to checksum them during the save, and while writing the record)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from megatron_zaya.checkpoint import format as checkpoint_format
    from megatron_zaya.patches import apply_patches

    apply_patches("cpu,checkpointing.checksums_while_writing")
    hashed = _count_reads(checkpoint_format)
    dist_checkpointing.save(_state(rank, world, fill=True), root, TorchDistSaveShardedStrategy("torch_dist", 1))
    during = [Path(p).name for p in hashed]
    if rank == 0:
        checkpoint_format.write_checksums(root)
    return during, sorted(Path(p).name for p in hashed[len(during):])


def test_a_synchronous_save_checksums_its_files_as_it_writes_them(tmp_path):
    """Only the files no writer wrote (the metadata, written at the finalization) are read for the checksums;
    the record equals the CRC-32 of every file, and catches a flipped byte."""
    from megatron_zaya.checkpoint import CHECKSUMS, damage, recorded_files

    root = tmp_path / "ckpt"
    root.mkdir()
    (during_0, record_0), (during_1, record_1) = run_ranks(_save_synchronously, 2, tmp_path, str(root))
    assert during_0 == during_1 == [] and record_1 == []  # the writers read nothing back
    assert record_0 == [".metadata", "metadata.json"], record_0
    files = sorted(p.name for p in root.iterdir() if p.name != CHECKSUMS)
    assert {"__0_0.distcp", "__1_0.distcp"} < set(files), files
    table = recorded_files(root)
    assert table == {name: [len(data := (root / name).read_bytes()), zlib.crc32(data)] for name in files}
    shard = bytearray((root / "__1_0.distcp").read_bytes())
    shard[len(shard) // 2] ^= 0xFF
    (root / "__1_0.distcp").write_bytes(bytes(shard))
    assert damage(root, files, table) == ["__1_0.distcp differs from its checksum at save"]
