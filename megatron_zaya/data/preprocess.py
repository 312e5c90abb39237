"""`zaya-preprocess`: tokenise .txt / .jsonl files into a Megatron `.bin/.idx` dataset.

    zaya-preprocess data/*.jsonl --output-prefix data/corpus --workers 4
    zaya-pretrain ... --data-path data/corpus --tokenizer-type HuggingFaceTokenizer --tokenizer-model <same tokenizer>

Each document is encoded the way Megatron's HuggingFaceTokenizer encodes text (the tokenizer's own
special tokens included, e.g. a BOS where its template adds one), then the EOS id, Megatron's `.eod`,
is appended. The files are written under a temporary name and renamed at the end, so a failed or
interrupted run leaves nothing behind and a reader never sees half a dataset. The embedded corpus's
dataset (`embedded_dataset_prefix`, the default data of zaya-pretrain) is built the same way, once per cache.
"""

import argparse
import collections
import contextlib
import functools
import hashlib
import multiprocessing
import multiprocessing.pool
import os
import re
import sys
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from ..errors import USAGE_EXIT_CODE, InputError
from .documents import expand_inputs, read_documents
from .embedded import EMBEDDED_CORPUS, EMBEDDED_DIR, embedded_tokenizer_dir
from .tokenizer_json import TokenizerJson

DOCUMENTS_PER_BATCH = 64
BATCH_CHARS = 1 << 20  # a batch ends at this many characters too, so that long documents are not held 64 at a time


@dataclass(frozen=True)
class DatasetSummary:
    prefix: str
    documents: int
    tokens: int
    dtype: type


def load_tokenizer(name_or_dir: str):
    """A transformers fast tokenizer, loaded the way Megatron's HuggingFaceTokenizer loads it; a directory of the
    generic fast class is read without transformers (:class:`~.tokenizer_json.TokenizerJson`, the same ids)."""
    path = os.path.expanduser(name_or_dir)
    if name_or_dir.startswith(("/", ".", "~")) and not os.path.isdir(path):
        raise InputError(f"tokenizer directory {name_or_dir} does not exist; check --tokenizer")
    if TokenizerJson.serves(path):
        return TokenizerJson(path)
    try:
        from transformers import AutoTokenizer
    except ModuleNotFoundError:
        raise InputError("transformers is not installed; pip install 'megatron-zaya[hf]'") from None
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises many types (OSError, ValueError, HF hub errors)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(
            f"cannot load tokenizer '{name_or_dir}' ({reason}); pass a directory holding tokenizer.json "
            "and tokenizer_config.json, or a cached Hugging Face model name"
        ) from None


def encode_documents(tokenizer, texts: Iterable[str], eod: int | None) -> list[np.ndarray]:
    """Token ids of each document, `eod` appended unless it is None. Returns int32 arrays [n_tokens] (a
    dataset's dtype is uint16 or int32: `DType.optimal_dtype`).

    A document longer than PIECE_CHARS is tokenised in pieces (`_encode_in_pieces`): the tokenizer holds
    about 170 bytes per character of the text it is given, so a 34 MB line would take 5 GB at once.
    """
    texts = list(texts)
    tail = [] if eod is None else [eod]
    short = [text for text in texts if len(text) <= PIECE_CHARS]
    short = iter(tokenizer(short, verbose=False)["input_ids"] if short else [])
    return [
        np.asarray(next(short) + tail, dtype=np.int32) if len(text) <= PIECE_CHARS
        else _encode_in_pieces(tokenizer, text, tail)
        for text in texts
    ]


PIECE_CHARS = 1 << 14  # characters the tokenizer is given at once
SEAM_CHARS = 1 << 8  # context on either side of a cut that must tokenise the same cut or whole
SEAM_TRIES = 64  # candidates tried for one cut before the rest of the document is tokenised whole
_CUT_CANDIDATES = re.compile(r"(?<=\S)(?=\s)|(?<=\s)(?=\S)")  # where whitespace begins or ends


def _encode_in_pieces(tokenizer, text: str, tail: list[int]) -> np.ndarray:
    """The ids `tokenizer(text)` gives, from pieces of about PIECE_CHARS characters.

    Each cut is where whitespace begins or ends and where the tokenizer gives the same ids to the
    SEAM_CHARS on either side whether they are cut there or not: its pre-tokenizer (byte-level BPE's
    regexes, Metaspace) splits there anyway, and merges never cross such a split. A text without such
    a cut is tokenised whole. The special tokens the tokenizer adds around a document (a BOS, say) are
    taken from the first piece.
    """
    pieces, start = [], 0
    while start < len(text):
        end = _cut(tokenizer, text, start + PIECE_CHARS)
        ids = tokenizer(text[start:end], add_special_tokens=False, verbose=False)["input_ids"]
        if start == 0:  # around the first piece: its ids plus the special tokens of a whole document
            with_special = tokenizer(text[:end], verbose=False)["input_ids"]
            at = next(i for i in range(len(with_special) - len(ids) + 1) if with_special[i : i + len(ids)] == ids)
            suffix = with_special[at + len(ids) :]
            ids = with_special[: at + len(ids)]
        pieces.append(np.asarray(ids, dtype=np.int32))
        start = end
    return np.concatenate([*pieces, np.asarray(suffix + tail, dtype=np.int32)])


def _cut(tokenizer, text: str, target: int) -> int:
    """The first clean cut at or after `target` (see `_encode_in_pieces`), or the end of the text."""
    if target >= len(text):
        return len(text)
    for tries, candidate in enumerate(_CUT_CANDIDATES.finditer(text, target)):
        cut = candidate.start()
        if tries == SEAM_TRIES:
            return len(text)  # the tokenizer joins across whitespace here: only the whole text is exact
        left, right = text[max(0, cut - SEAM_CHARS) : cut], text[cut : cut + SEAM_CHARS]
        apart_left, apart_right, together = tokenizer(
            [left, right, left + right], add_special_tokens=False, verbose=False
        )["input_ids"]
        if apart_left + apart_right == together:
            return cut
    return len(text)


def write_indexed_dataset(
    inputs: list[str],
    output_prefix: str,
    tokenizer: str,
    *,
    json_key: str = "text",
    split_lines: bool = False,
    append_eod: bool = True,
    workers: int = 1,
    overwrite: bool = False,
    progress: bool = True,
) -> DatasetSummary:
    """Tokenise every document of `inputs` (files or globs) into `output_prefix`.bin/.idx.

    Documents keep input order whatever `workers` is, so the output bytes do not depend on it.
    Raises InputError, having written nothing, on any bad input.
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path

    paths = expand_inputs(inputs)
    _check_output(output_prefix, overwrite)
    if workers < 1:
        raise InputError(f"--workers {workers}: need at least 1 worker")
    tok = load_tokenizer(tokenizer)
    eod = tok.eos_token_id if append_eod else None
    if append_eod and eod is None:
        raise InputError(
            f"tokenizer '{tokenizer}' has no eos_token to use as EOD; "
            "set one in its tokenizer_config.json or pass --no-append-eod"
        )
    dtype = DType.optimal_dtype(len(tok))

    documents = (doc for path in paths for doc in read_documents(path, json_key, split_lines))
    batches = _batches(documents)
    temp_prefix = f"{output_prefix}.tmp-{uuid.uuid4().hex[:12]}"  # unique across ranks and hosts
    n_documents = n_tokens = 0
    builder = None
    try:
        builder = IndexedDatasetBuilder(get_bin_path(temp_prefix), dtype=dtype)
        with (
            _worker_pool(tok, eod, workers) as pool,
            tqdm(desc="tokenizing", unit="doc", disable=None if progress else True) as bar,  # None: tty only
        ):
            for encoded in _encode_in_order(batches, tok, eod, pool, workers):
                for doc in encoded:
                    builder.add_document(doc, [doc.size])
                    n_tokens += doc.size
                n_documents += len(encoded)
                bar.update(len(encoded))
        builder.finalize(get_idx_path(temp_prefix))
        if n_documents == 0:
            raise InputError(
                f"no documents in {', '.join(inputs)}: the inputs are empty or blank; check the files and --json-key"
            )
        # .idx last: its presence means the dataset is complete.
        os.replace(get_bin_path(temp_prefix), get_bin_path(output_prefix))
        os.replace(get_idx_path(temp_prefix), get_idx_path(output_prefix))
    except OSError as error:  # a full disk, or a place that takes no files (os.access cannot tell for root)
        raise InputError(f"writing {output_prefix}.bin/.idx failed ({error.strerror or error}); free space or change "
                         "--output-prefix") from error
    finally:
        if builder is not None:  # its file is closed by finalize() unless we failed before it
            with contextlib.suppress(OSError):  # (its buffered bytes, where the write failed)
                builder.data_file.close()
        for path in (get_bin_path(temp_prefix), get_idx_path(temp_prefix)):
            if os.path.exists(path):
                os.remove(path)
    return DatasetSummary(output_prefix, n_documents, n_tokens, dtype)


def _check_output(output_prefix: str, overwrite: bool) -> None:
    from megatron.core.datasets.indexed_dataset import get_bin_path, get_idx_path

    directory = os.path.dirname(output_prefix) or "."
    if not os.path.isdir(directory):
        raise InputError(f"output directory {directory} does not exist; create it or change --output-prefix")
    if not os.access(directory, os.W_OK):
        raise InputError(f"output directory {directory} is not writable; fix its permissions or change --output-prefix")
    for path in (get_bin_path(output_prefix), get_idx_path(output_prefix)):
        if os.path.exists(path) and not overwrite:
            raise InputError(f"{path} already exists; pass --overwrite to replace it or change --output-prefix")


def _batches(documents: Iterable[str]) -> Iterator[list[str]]:
    """Consecutive documents, DOCUMENTS_PER_BATCH of them or fewer that reach BATCH_CHARS."""
    batch, chars = [], 0
    for document in documents:
        batch.append(document)
        chars += len(document)
        if len(batch) == DOCUMENTS_PER_BATCH or chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


@contextlib.contextmanager
def _worker_pool(tok, eod: int | None, workers: int) -> Iterator[multiprocessing.pool.Pool | None]:
    """None for one worker, else `workers` forked processes that inherit the loaded tokenizer.

    fork, not spawn/forkserver: those re-import megatron and transformers in every pool (~10 s). The
    pool is made before the progress bar starts its monitor thread, and the workers only run the Rust
    tokenizer, single-threaded.
    """
    if workers == 1:
        yield None
        return
    with multiprocessing.get_context("fork").Pool(workers, initializer=_init_worker, initargs=(tok, eod)) as pool:
        yield pool


def _encode_in_order(batches, tok, eod, pool, workers: int) -> Iterator[list[np.ndarray]]:
    """Encoded batches in input order; with a pool, at most 2 * workers batches are in flight."""
    if pool is None:
        for batch in batches:
            yield encode_documents(tok, batch, eod)
        return
    pending = collections.deque()
    for batch in batches:  # documents are read (and validated) here, in this process
        pending.append(pool.apply_async(_encode_in_worker, (batch,)))
        if len(pending) >= 2 * workers:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


_worker_state = {}


def _init_worker(tok, eod: int | None) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: --workers is the parallelism
    _worker_state.update(tokenizer=tok, eod=eod)


def _encode_in_worker(batch: list[str]) -> list[np.ndarray]:
    return encode_documents(_worker_state["tokenizer"], batch, _worker_state["eod"])


@functools.cache
def _embedded_digest() -> str:
    """The first 12 hex digits of the SHA-256 of the embedded corpus and tokenizer (read once per process)."""
    digest = hashlib.sha256()
    for path in (EMBEDDED_CORPUS, EMBEDDED_DIR / "tokenizer.json"):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def embedded_dataset_prefix(cache_dir: str, build: bool = True) -> str:
    """Tokenise the embedded corpus into `cache_dir` (once) and return the prefix for `--data-path`
    (with ``build=False`` only the prefix: nothing is written).

    One document per chapter, each ending in `<eos>`. The file name carries a hash of the corpus
    and the tokenizer, so a rebuilt tokenizer never reuses stale tokens. Writing goes through a
    temporary name and a rename, so concurrent callers (several ranks) are safe.
    """
    prefix = os.path.join(cache_dir, f"austen-{_embedded_digest()}")
    if build and not os.path.exists(prefix + ".idx"):  # .idx is renamed into place last
        os.makedirs(cache_dir, exist_ok=True)
        write_indexed_dataset([str(EMBEDDED_CORPUS)], prefix, embedded_tokenizer_dir(), overwrite=True, progress=False)
    return prefix


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="zaya-preprocess",
        description="Tokenise .txt/.jsonl files (optionally .gz) into a Megatron .bin/.idx dataset.",
    )
    parser.add_argument("inputs", nargs="+", help="input files or globs (quote globs)")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory or HF name (default: the embedded one)")
    parser.add_argument("--json-key", default="text", help="key of the document text in .jsonl lines")
    parser.add_argument("--split-lines", action="store_true", help=".txt: one document per line, not per paragraph")
    parser.add_argument(
        "--no-append-eod", dest="append_eod", action="store_false", help="do not end documents with EOD"
    )
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing PREFIX.bin/.idx")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.tokenizer is None:
        args.tokenizer = embedded_tokenizer_dir()
    try:
        summary = write_indexed_dataset(
            args.inputs,
            args.output_prefix,
            args.tokenizer,
            json_key=args.json_key,
            split_lines=args.split_lines,
            append_eod=args.append_eod,
            workers=args.workers,
            overwrite=args.overwrite,
        )
    except InputError as e:
        print(f"zaya-preprocess: error: {e}", file=sys.stderr)
        sys.exit(USAGE_EXIT_CODE)
    print(
        f"wrote {summary.documents} documents, {summary.tokens} tokens ({np.dtype(summary.dtype).name}) "
        f"to {summary.prefix}.bin/.idx"
    )


if __name__ == "__main__":
    main()
