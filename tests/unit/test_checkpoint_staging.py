"""A rank's checkpoint tensors written in one pass (checkpoint/staging.py): the bytes of every dtype and shape come
back exactly, the checksums recorded while writing equal the files' CRC-32 read back, files split at their size
limit, and the host pool's chunks (here on CPU tensors, as on a GPU it copies device tensors) carry every byte in
order, a tensor spanning several chunks and chunks spanning tensors alike."""

from __future__ import annotations

import zlib

import torch

from megatron_zaya.checkpoint.staging import HostPool, read_tensors, write_tensors


def _tensors() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(3, 5, generator=generator), torch.randn(7, generator=generator).to(torch.bfloat16),
            torch.arange(11, dtype=torch.int64), torch.tensor(2.5, dtype=torch.float64), torch.zeros(0),
            torch.tensor([True, False, True]), torch.randn(4, 6, generator=generator).t()]  # not contiguous


def test_tensors_come_back_exactly_with_the_checksums_of_their_files(tmp_path):
    tensors = _tensors()
    specs, table = write_tensors(tmp_path, "tensors", tensors, limit=40)
    assert sorted(table) == [f"tensors.{i:03d}.bin" for i in range(len(table))] and len(table) > 4
    for name, (size, crc) in table.items():
        data = (tmp_path / name).read_bytes()
        assert size == len(data) <= 40 and crc == zlib.crc32(data), name
    back = read_tensors(tmp_path, "tensors", specs)
    assert all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(tensors, back))


def test_the_pool_carries_every_byte_in_order_through_reused_chunks():
    pool = HostPool(chunk=7, slots=2)
    flats = [t.contiguous().reshape(-1).view(torch.uint8) for t in _tensors()]
    pieces = []
    pool.copy_out(flats, lambda view: pieces.append(bytes(view)))
    assert b"".join(pieces) == b"".join(bytes(f.numpy()) for f in flats)
    assert max(map(len, pieces)) == 7 and len(pool.buffers) == 2
