"""The default data shipped with the package: three Jane Austen novels and a 4096-entry BPE tokenizer.

See embedded/README.md for the source, the licence and how build_embedded.py makes them.
"""

import hashlib
import os
from pathlib import Path

from .preprocess import write_indexed_dataset

EMBEDDED_DIR = Path(__file__).parent / "embedded"
EMBEDDED_CORPUS = EMBEDDED_DIR / "austen.jsonl.gz"


def embedded_tokenizer_dir() -> str:
    """Directory for `--tokenizer-type HuggingFaceTokenizer --tokenizer-model <dir>`.

    Byte-level BPE, vocab 4096: `<pad>`=0, `<eos>`=1 (Megatron's `.eod`), `<bos>`=2, `<unk>`=3.
    """
    return str(EMBEDDED_DIR)


def embedded_dataset_prefix(cache_dir: str) -> str:
    """Tokenise the embedded corpus into `cache_dir` (once) and return the prefix for `--data-path`.

    One document per chapter, each ending in `<eos>`. The file name carries a hash of the corpus
    and the tokenizer, so a rebuilt tokenizer never reuses stale tokens. Writing goes through a
    temporary name and a rename, so concurrent callers (several ranks) are safe.
    """
    digest = hashlib.sha256()
    for path in (EMBEDDED_CORPUS, EMBEDDED_DIR / "tokenizer.json"):
        digest.update(path.read_bytes())
    prefix = os.path.join(cache_dir, f"austen-{digest.hexdigest()[:12]}")
    if not os.path.exists(prefix + ".idx"):  # .idx is renamed into place last
        os.makedirs(cache_dir, exist_ok=True)
        write_indexed_dataset([str(EMBEDDED_CORPUS)], prefix, embedded_tokenizer_dir(), overwrite=True, progress=False)
    return prefix
