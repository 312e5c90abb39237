"""Check a Megatron indexed dataset (``prefix.bin`` + ``prefix.idx``) before training reads it.

Megatron trusts both files: a truncated ``.bin`` is memory-mapped and fails (or returns garbage) at the
first sample past its end, a damaged ``.idx`` fails with an assert deep in dataset building (or, a pointer
in the middle, only once training reaches it), a corpus shorter than one sequence fails while building the
sample index, and a split with no sequence (a small corpus with the default ``--split``) makes Megatron's
epoch count loop forever. These checks read the ``.idx`` lengths and pointers (12 bytes per sequence, in
chunks) and the ``.bin`` size, never the tokens.

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
SPLITS = ("train", "validation", "test")
DEFAULT_SPLIT = "969, 30, 1"  # Megatron's when --split is not given
_CHUNK = 1 << 24  # sequences read at a time


def _pointer_problem(idx: Path, sequences: int, itemsize: int) -> str | None:
    """Each sequence must start where the previous one ends (Megatron writes them back to back)."""
    lengths = np.memmap(idx, np.int32, "r", HEADER_BYTES, (sequences,))
    pointers = np.memmap(idx, np.int64, "r", HEADER_BYTES + 4 * sequences, (sequences,))
    if pointers[0] != 0:
        return f"{idx}: the first sequence starts at byte {int(pointers[0])}, not 0 (damaged); {REBUILD}"
    for start in range(0, sequences, _CHUNK):
        stop = min(start + _CHUNK + 1, sequences)
        expected = pointers[start:stop - 1] + lengths[start:stop - 1].astype(np.int64) * itemsize
        bad = np.flatnonzero((expected != pointers[start + 1:stop]) | (lengths[start:stop - 1] < 0))
        if bad.size:
            i = start + int(bad[0]) + 1
            return f"{idx}: the pointer or length of sequence {i} of {sequences} is damaged; {REBUILD}"
    return None


def split_problem(prefix: str, split: str, seq_length: int | None) -> str | None:
    """A ``--split`` share with no sequence of ``prefix`` (or, for training, too few tokens for one sample)."""
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    idx = Path(prefix + ".idx")
    with idx.open("rb") as stream:
        _, _, sequences, _ = struct.unpack("<QBQQ", stream.read(HEADER_BYTES)[9:])
    lengths = np.memmap(idx, np.int32, "r", HEADER_BYTES, (sequences,))
    shares = parse_and_normalize_split(split)
    bounds = np.cumsum([0.0, *shares])
    for name, share, begin, end in zip(SPLITS, shares, bounds[:-1], bounds[1:], strict=True):
        first, last = int(round(begin * sequences)), int(round(end * sequences))
        if share == 0:
            continue
        needed = seq_length + 1 if name == "train" and seq_length else 1
        if int(lengths[first:last].sum(dtype=np.int64)) < needed:
            fixed = ",".join("0" if n == name else f"{s * 100:g}" for n, s in zip(SPLITS, shares, strict=True))
            return (f"--split {split} leaves the {name} split of {prefix} ({sequences} sequences) with "
                    f"{last - first} sequences, too few for {'one training sample' if needed > 1 else 'Megatron'}; "
                    f"give it no share (--split {fixed}) or add data")
    return None


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
    problem = _pointer_problem(idx, sequences, ITEMSIZE[code])
    if problem:
        return problem
    tokens = bin_bytes // ITEMSIZE[code]
    if seq_length is not None and tokens < seq_length + 1:
        return (f"{prefix} holds {tokens} tokens, fewer than one training sequence (--seq-length {seq_length} + 1); "
                "add data or shorten --seq-length")
    return None
