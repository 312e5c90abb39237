"""Copies of the in-memory tier's parts on another node, so that losing a node's host memory loses no checkpoint.

Nodes: torchrun starts ``LOCAL_WORLD_SIZE`` ranks per node, node by node, so ``rank // LOCAL_WORLD_SIZE`` is a
rank's node. In a data-parallel group of n ranks (in rank order), m of them on each node, the rank at position
i sends its part to position (i + m) mod n, on the next node, and keeps the part of position (i - m) mod n; a
group on one node (m = n) makes no copies.

The bytes go over a gloo group (host memory, whatever the training backend) by paired ``isend``/``irecv``: a
header (the files and their checksum record, or nothing) then each file in chunks. At a save, every rank sends
to its keeper from the local tier's thread, after its part is written, over that thread's own group, so that
training goes on and no message mixes with the training loop's; at a resume, the ranks that need a part
(gathered) receive it over the data-parallel gloo group. A rank with nothing to send sends an empty header, so
ranks that disagree about what exists never wait on each other.
The receiver checksums the bytes as they arrive and writes the checksum record last, only when every file
matches it: a copy received halfway, or damaged on the way, is never complete.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path

import torch

from .format import CHECKSUMS, recorded_files, write_checksum_table

CHUNK_BYTES = 64 << 20


def node_size() -> int:
    """Ranks per node: torchrun's ``LOCAL_WORLD_SIZE``; one node for a process without a launcher."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", torch.distributed.get_world_size()))


def partners(group: list[int], per_node: int, rank: int) -> tuple[int | None, int | None]:
    """(the rank that keeps ``rank``'s copy, the rank whose copy ``rank`` keeps) in the data-parallel ``group``
    (global ranks, ascending), or (None, None) when the group has no rank on another node."""
    n, i = len(group), group.index(rank)
    m = sum(r // per_node == rank // per_node for r in group)
    if m == n:
        return None, None
    return group[(i + m) % n], group[(i - m) % n]


def _header(part: Path | None) -> bytes:
    """The files of a complete part and its checksum record; empty when there is no complete part."""
    record = recorded_files(part) if part is not None else None
    if record is None:
        return b""
    return json.dumps({"files": sorted(record.items())}).encode()


def exchange(group, send_to: int | None, part: Path | None, receive_from: int | None, into: Path | None) -> bool:
    """Send the complete part in ``part`` to rank ``send_to`` while receiving rank ``receive_from``'s into
    ``into`` (either side may be None). Returns whether a complete part was received."""
    dist = torch.distributed
    header = torch.tensor(list(_header(part)), dtype=torch.uint8) if send_to is not None else None

    def swap(outgoing: torch.Tensor | None, incoming: torch.Tensor | None) -> None:
        works = []
        if outgoing is not None:
            works.append(dist.isend(outgoing, dst=send_to, group=group))
        if incoming is not None:
            works.append(dist.irecv(incoming, src=receive_from, group=group))
        for work in works:
            work.wait()

    size_in = torch.zeros(1, dtype=torch.int64) if receive_from is not None else None
    swap(torch.tensor([len(header)], dtype=torch.int64) if header is not None else None, size_in)
    header_in = torch.empty(int(size_in), dtype=torch.uint8) if size_in is not None else None
    swap(header if header is not None and len(header) else None,
         header_in if header_in is not None and len(header_in) else None)
    files_out = json.loads(bytes(header.numpy()))["files"] if header is not None and len(header) else []
    files_in = json.loads(bytes(header_in.numpy()))["files"] if header_in is not None and len(header_in) else []

    chunks_out = [(name, start, min(CHUNK_BYTES, size - start)) for name, (size, _) in files_out
                  for start in range(0, size, CHUNK_BYTES)]
    chunks_in = [(name, start, min(CHUNK_BYTES, size - start)) for name, (size, _) in files_in
                 for start in range(0, size, CHUNK_BYTES)]
    if files_in:
        shutil.rmtree(into, ignore_errors=True)
        into.mkdir(parents=True)
    crcs = {name: 0 for name, _ in files_in}
    streams: dict[str, object] = {}
    buffer_out = torch.empty(min(CHUNK_BYTES, max((c[2] for c in chunks_out), default=0)), dtype=torch.uint8)
    buffer_in = torch.empty(min(CHUNK_BYTES, max((c[2] for c in chunks_in), default=0)), dtype=torch.uint8)
    try:
        for k in range(max(len(chunks_out), len(chunks_in))):
            outgoing = incoming = None
            if k < len(chunks_out):
                name, start, length = chunks_out[k]
                with (part / name).open("rb") as stream:
                    stream.seek(start)
                    stream.readinto(memoryview(buffer_out.numpy())[:length])
                outgoing = buffer_out[:length]
            if k < len(chunks_in):
                incoming = buffer_in[: chunks_in[k][2]]
            swap(outgoing, incoming)
            if incoming is not None:
                name = chunks_in[k][0]
                if name not in streams:
                    (into / name).parent.mkdir(parents=True, exist_ok=True)
                    streams[name] = (into / name).open("wb")
                data = memoryview(incoming.numpy())
                streams[name].write(data)
                crcs[name] = zlib.crc32(data, crcs[name])
    finally:
        for stream in streams.values():
            stream.close()
    if not files_in:
        return False
    for name, (size, crc) in files_in:  # empty files have no chunk
        if size == 0:
            (into / name).touch()
    if any(crcs[name] != crc for name, (_, crc) in files_in):
        return False
    write_checksum_table(into, dict(files_in))
    return True


def gloo_group():
    """The data-parallel gloo group (with context parallelism) and its ranks."""
    from megatron.core import parallel_state as mpu

    group = mpu.get_data_parallel_group_gloo(with_context_parallel=True)
    return group, torch.distributed.get_process_group_ranks(group)


def keeper_and_source() -> tuple[int | None, int | None]:
    """:func:`partners` of this rank in its data-parallel group."""
    _, ranks = gloo_group()
    return partners(sorted(ranks), node_size(), torch.distributed.get_rank())


def send_copy(part: Path, copy, group) -> None:
    """At a save (every rank, over ``group``, which holds every rank): send this rank's part ``part`` to its
    keeper (nothing when it is not complete) and keep its source's part at ``copy(source)``."""
    keeper, source = keeper_and_source()
    if keeper is not None:
        exchange(group, keeper, part, source, copy(source))


def fetch(needs: list[bool], keepers: list[int | None], part: Path, copy) -> bool:
    """At a resume (every rank): each rank that ``needs`` its part receives it from its keeper into ``part``;
    a keeper sends the copy it holds (``copy(rank)``). Returns whether this rank received a complete part."""
    rank = torch.distributed.get_rank()
    keeper, source = keeper_and_source()
    send_to = source if source is not None and needs[source] and keepers[source] == rank else None
    receive_from = keeper if needs[rank] else None
    if send_to is None and receive_from is None:
        return False
    return exchange(gloo_group()[0], send_to, copy(source) if send_to is not None else None, receive_from, part)
