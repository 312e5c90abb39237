"""Checkpoint saves on two gloo ranks. A background save holds the state of its step, copied straight into the
host pool, while training changes the tensors before the files are written; the writer, in a background or a
synchronous save, checksums its files as it writes them, never reading them back."""

from __future__ import annotations

import re
import zlib
from pathlib import Path

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


def _save_change_and_load(rank, world, root):
    """Two ``torch_dist`` background saves of a sharded and a replicated tensor through ``background_request``,
    run as the training loop runs them: the next step's fence (``wait_for_copies``), the training tensors
    changed at once (the optimizer step), the writer process's wait, the finalization; returns, per save, the
    values loaded back, the values at the save, the writers' checksum records, how many files were read back
    to checksum them, the storages of the tensors Megatron's writer wrote, and the pool's buffers."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from megatron_zaya.checkpoint import format as checkpoint_format
    from megatron_zaya.checkpoint import staging
    from megatron_zaya.patches import apply_patches

    apply_patches("cpu,checkpointing.checksums_while_writing,checkpointing.no_record_crc_in_writes")
    training = _state(rank, world, fill=True)
    results = []
    for save in ("first", "second"):  # the second reuses the pool
        directory = Path(root) / save
        directory.mkdir(parents=True, exist_ok=True)
        at_save = {key: value.data.clone() for key, value in training.items()}
        request = dist_checkpointing.save(dict(training), directory, TorchDistSaveShardedStrategy("torch_dist", 1),
                                          async_sharded_save=True, async_strategy="mcore")
        written_from, write = [], request.async_fn

        def noting_storages(rank, write_buckets, results_queue, write=write, written_from=written_from):
            written_from += [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), t.nbytes)
                             for _, _, (_, items) in write_buckets for _, t in items]
            return write(rank, write_buckets, results_queue)

        request = staging.background_request(request._replace(async_fn=noting_storages))
        assert request.preload_fn is None  # the loop waits for no copy
        staging.wait_for_copies()  # the next step's finalize_model_grads
        for value in training.values():
            value.data.mul_(-3).add_(7)  # its optimizer step
        hashed = _count_reads(checkpoint_format)
        request.async_fn(*request.async_fn_args, **request.async_fn_kwargs)  # the writer process: waits
        for finalize in request.finalize_fns:
            finalize()
        loaded = dist_checkpointing.load(_state(rank, world, fill=False), directory)
        records = {p.name: checkpoint_format.recorded_files(directory, p.name)
                   for p in directory.glob(".zaya_checksums.json.rank-*")}
        pool = [(b.untyped_storage().data_ptr(), b.numel()) for b in staging._whole[0].segments]
        results.append((loaded, at_save, records, len(hashed), written_from, pool))
    return results


def test_a_background_save_writes_the_state_of_its_step_from_the_host_pool(tmp_path):
    """Every tensor Megatron's writer writes lies in the pool's one buffer, the size of the rank's tensors (rank
    0 writes its 256 B shard and the 1 KiB replicated tensor, rank 1 its shard), the same buffer at every save:
    no other copy of the state is made; each in a storage of its own size (``torch.save`` writes a tensor's whole
    storage)."""
    for rank, saves in enumerate(run_ranks(_save_change_and_load, 2, tmp_path, str(tmp_path / "ckpt"))):
        state = [256 + 1024, 256][rank]
        assert saves[0][5] == saves[1][5] and [size for _, size in saves[0][5]] == [state], (rank, saves[0][5])
        (start, _), = saves[0][5]
        for save, (loaded, at_save, records, hashed, written_from, pool) in zip(("first", "second"), saves):
            assert sorted((ptr - start, stored, size) for ptr, stored, size in written_from) == (
                [(0, 256, 256), (256, 1024, 1024)] if rank == 0 else [(0, 256, 256)]), (rank, written_from)
            for key, value in at_save.items():
                torch.testing.assert_close(loaded[key], value, rtol=0, atol=0)
            assert sorted(records) == [f".zaya_checksums.json.rank-{r:05d}" for r in range(2)], records
            assert hashed == 0  # checksummed as written, never read back
            for name, table in records.items():  # what the writers recorded is what the files hold
                assert table and all([len(data := (tmp_path / "ckpt" / save / file).read_bytes()), zlib.crc32(data)]
                                     == size_crc for file, size_crc in table.items()), (name, table)


def _save_synchronously(rank, world, root, patches="cpu,checkpointing.checksums_while_writing"):
    """A synchronous ``torch_dist`` save of the two tensors with ``patches``, then rank 0's ``zaya_checksums.json``
    as the tracker writes it; returns (the files read back to checksum them during the save, and while writing the
    record), and the tensors loaded back."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from megatron_zaya.checkpoint import format as checkpoint_format
    from megatron_zaya.patches import apply_patches

    apply_patches(patches)
    hashed = _count_reads(checkpoint_format)
    dist_checkpointing.save(_state(rank, world, fill=True), root, TorchDistSaveShardedStrategy("torch_dist", 1))
    during = [Path(p).name for p in hashed]
    if rank == 0:
        checkpoint_format.write_checksums(root)
    loaded = dist_checkpointing.load(_state(rank, world, fill=False), root)
    return during, sorted(Path(p).name for p in hashed[len(during):]), loaded


def test_a_synchronous_save_checksums_its_files_as_it_writes_them(tmp_path):
    """Only the files no writer wrote (the metadata, written at the finalization) are read for the checksums;
    the record equals the CRC-32 of every file, and catches a flipped byte."""
    from megatron_zaya.checkpoint import CHECKSUMS, damage, recorded_files

    root = tmp_path / "ckpt"
    root.mkdir()
    (during_0, record_0, _), (during_1, record_1, _) = run_ranks(_save_synchronously, 2, tmp_path, str(root))
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


def _storage_crcs(data: bytes) -> list[int]:
    """The CRC-32 of every tensor storage record (``archive/data/<n>``) in ``data``, from the zip central
    directories' entries: a ``.distcp`` file is the ``torch.save`` zips of its items one after the other."""
    crcs = []
    for entry in re.finditer(rb"PK\x01\x02", data):
        at = entry.start()
        name = data[at + 46:at + 46 + int.from_bytes(data[at + 28:at + 30], "little")]
        if re.fullmatch(rb"[^/]+/data/\d+", name):
            crcs.append(int.from_bytes(data[at + 16:at + 20], "little"))
    return crcs


def test_the_writers_torch_save_skips_the_record_crcs_the_file_checksums_cover(tmp_path):
    """``checkpointing.no_record_crc_in_writes``: the tensors' zip records in the ``.distcp`` files carry no CRC-32
    (the pass that held the GIL was skipped), where a plain ``torch.save`` of this process has them; the tensors
    load back equal and the files match their checksums."""
    import io

    from megatron_zaya.checkpoint import recorded_files

    root = tmp_path / "ckpt"
    root.mkdir()
    patches = "cpu,checkpointing.checksums_while_writing,checkpointing.no_record_crc_in_writes"
    for rank, (_, _, loaded) in enumerate(run_ranks(_save_synchronously, 2, tmp_path, str(root), patches)):
        for key, value in _state(rank, 2, fill=True).items():
            torch.testing.assert_close(loaded[key], value.data, rtol=0, atol=0)
    table, shards = recorded_files(root), sorted(root.glob("*.distcp"))
    assert len(shards) == 2 and all(table[p.name] == [len(d := p.read_bytes()), zlib.crc32(d)] for p in shards)
    written = [crc for p in shards for crc in _storage_crcs(p.read_bytes())]
    assert written == [0, 0, 0], written  # two shards and the replicated tensor
    replicated, plain = _state(0, 2, fill=True)["replicated"].data, io.BytesIO()
    torch.save(replicated, plain)
    assert _storage_crcs(plain.getvalue()) == [zlib.crc32(replicated.numpy())]
