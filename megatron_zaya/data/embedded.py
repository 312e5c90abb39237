"""The default data shipped with the package: three Jane Austen novels and a 4096-entry BPE tokenizer.

See embedded/README.md for the source, the licence and how build_embedded.py makes them; preprocess.py
tokenises the corpus (``embedded_dataset_prefix``).
"""

from pathlib import Path

EMBEDDED_DIR = Path(__file__).parent / "embedded"
EMBEDDED_CORPUS = EMBEDDED_DIR / "austen.jsonl.gz"


def embedded_tokenizer_dir() -> str:
    """Directory for `--tokenizer-type HuggingFaceTokenizer --tokenizer-model <dir>`.

    Byte-level BPE, vocab 4096: `<pad>`=0, `<eos>`=1 (Megatron's `.eod`), `<bos>`=2, `<unk>`=3.
    """
    return str(EMBEDDED_DIR)
