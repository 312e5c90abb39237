"""Check a Megatron indexed dataset (``prefix.bin`` + ``prefix.idx``) before training reads it.

Megatron trusts both files: a truncated ``.bin`` is memory-mapped and fails (or returns garbage) at the
first sample past its end, a damaged ``.idx`` fails with an assert deep in dataset building, and a corpus
shorter than one sequence fails while building the sample index. These checks read the 34-byte header and
the last sequence's pointer and length only, so they cost the same for a kilobyte or a terabyte.

Layout (``megatron.core.datasets.indexed_dataset``): header ``MMIDIDX\\0\\0``, version ``<Q`` (1), dtype
code ``<B``, sequence count S ``<Q``, document count D ``<Q``, then int32 lengths[S], int64 byte pointers[S],
int64 document indices[D] (and S mode bytes for multimodal data).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

HEADER = b"MMIDIDX\x00\x00"
HEADER_BYTES = 34
ITEMSIZE = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}  # Megatron DType code -> bytes per token
REBUILD = "rebuild it with zaya-preprocess (or copy it again)"


def indexed_dataset_problem(prefix: str, seq_length: int | None) -> str | None:
    """One line naming what is wrong with ``prefix.bin``/``.idx`` and the fix, or None if they look sound."""
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    idx_size = idx.stat().st_size
    with idx.open("rb") as stream:
        head = stream.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[:9] != HEADER:
        return f"{idx} is not a Megatron index (bad or truncated header); {REBUILD}"
    version, code, sequences, documents = struct.unpack("<QBQQ", head[9:])
    if version != 1 or code not in ITEMSIZE:
        return f"{idx} has an unknown version {version} or token type {code}; {REBUILD}"
    expected = HEADER_BYTES + 12 * sequences + 8 * documents
    if idx_size not in (expected, expected + sequences):
        return f"{idx} has {idx_size} bytes but its header describes {expected} (truncated or damaged); {REBUILD}"
    if sequences == 0:
        return f"{prefix} holds no sequences; {REBUILD} from a non-empty corpus"
    last_length = int(np.memmap(idx, np.int32, "r", HEADER_BYTES + 4 * (sequences - 1), (1,))[0])
    last_pointer = int(np.memmap(idx, np.int64, "r", HEADER_BYTES + 4 * sequences + 8 * (sequences - 1), (1,))[0])
    bin_bytes = last_pointer + last_length * ITEMSIZE[code]
    if bin_.stat().st_size != bin_bytes:
        return (f"{bin_} has {bin_.stat().st_size} bytes but {idx.name} indexes {bin_bytes} (truncated, or the two "
                f"files come from different builds); {REBUILD}")
    tokens = bin_bytes // ITEMSIZE[code]
    if seq_length is not None and tokens < seq_length + 1:
        return (f"{prefix} holds {tokens} tokens, fewer than one training sequence (--seq-length {seq_length} + 1); "
                "add data or shorten --seq-length")
    return None
