"""Regenerate the embedded corpus and tokenizer in megatron_zaya/data/embedded/.

The corpus is three public-domain Jane Austen novels, taken from Debian's `r-cran-janeaustenr`
package (R data, MIT-licensed packaging of the Project Gutenberg texts). One JSON line per chapter:
{"title": ..., "chapter": n, "text": ...}, paragraphs separated by a blank line, the hard line wraps
of the Gutenberg files undone. The tokenizer is a byte-level BPE with 4096 entries trained on it.

Maintainer tool, not needed at run time. It needs `dpkg-deb` and the pure-python `rdata` reader:

    apt-get download r-cran-janeaustenr     # no R install needed
    pip install rdata
    python -m megatron_zaya.data.build_embedded --deb r-cran-janeaustenr_1.0.0-1_all.deb

Both outputs are deterministic: running it twice gives identical bytes.
"""

import argparse
import gzip
import json
import re
import struct
import subprocess
import tempfile
import zlib
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .embedded import EMBEDDED_CORPUS, EMBEDDED_DIR

VOCAB_SIZE = 4096
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")  # ids 0, 1, 2, 3 in this order

# R object name in the package -> title. The three shorter novels: 1.8 MB of text.
NOVELS = {
    "prideprejudice": "Pride and Prejudice",
    "sensesensibility": "Sense and Sensibility",
    "persuasion": "Persuasion",
}
R_DATA_DIR = "usr/lib/R/site-library/janeaustenr/data"
CHAPTER_HEADING = re.compile(r"^chapter (\d+|[ivxlc]+)$", re.IGNORECASE)
END_MARK = re.compile(r"^(the end|finis)$", re.IGNORECASE)


def read_novel_lines(data_dir: Path) -> dict[str, list[str]]:
    """Read each novel's character vector (one string per Gutenberg line) from R's lazy-load DB.

    Rdata.rdx is a gzipped RDS index {name: (offset, length)} into Rdata.rdb, where each object is
    a 4-byte big-endian size followed by a zlib-compressed R serialization.
    """
    import rdata  # maintainer-only dependency

    index = rdata.read_rds(data_dir / "Rdata.rdx")["variables"]
    blob = (data_dir / "Rdata.rdb").read_bytes()
    novels = {}
    for name in NOVELS:
        offset, length = (int(x) for x in index[name])
        (size,) = struct.unpack(">I", blob[offset : offset + 4])
        serialized = zlib.decompress(blob[offset + 4 : offset + length])
        assert len(serialized) == size, f"{name}: corrupt lazy-load record"
        novels[name] = [str(line) for line in rdata.conversion.convert(rdata.parser.parse_data(serialized))]
    return novels


def paragraphs(lines: list[str]) -> list[str]:
    """Blank-line-separated blocks, each unwrapped to one line (the Gutenberg files wrap at ~70)."""
    blocks, current = [], []
    for line in lines + [""]:
        if line.strip():
            current.append(line.strip())
        elif current:
            blocks.append(" ".join(current))
            current = []
    return blocks


def chapters(lines: list[str]) -> list[str]:
    """Split a novel into chapter texts; the title page before chapter 1 and the end mark are dropped."""
    result = []
    for block in paragraphs(lines):
        if CHAPTER_HEADING.match(block):
            result.append([block])
        elif result and not END_MARK.match(block):
            result[-1].append(block)
    return ["\n\n".join(blocks) for blocks in result]


def write_corpus(novels: dict[str, list[str]], path: Path) -> list[str]:
    """Write the chapters as gzipped JSON lines (mtime 0, so the bytes are reproducible)."""
    texts = []
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        for name, title in NOVELS.items():
            for number, text in enumerate(chapters(novels[name]), start=1):
                record = {"title": title, "chapter": number, "text": text}
                gz.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
                texts.append(text)
    return texts


def train_tokenizer(texts: list[str], out_dir: Path) -> None:
    """Byte-level BPE: every byte is in the alphabet, so any text round-trips and `<unk>` is never used."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    tokenizer.save(str(out_dir / "tokenizer.json"))

    # What transformers' AutoTokenizer (and so Megatron's HuggingFaceTokenizer) reads besides
    # tokenizer.json. No BOS/EOS is added on encode; Megatron appends `<eos>` per document itself.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": "<pad>",
        "eos_token": "<eos>",
        "bos_token": "<bos>",
        "unk_token": "<unk>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000_000,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--deb", type=Path, help="r-cran-janeaustenr .deb file (from `apt-get download`)")
    source.add_argument("--root", type=Path, default=Path("/"), help="where the package is installed")
    parser.add_argument("--out-dir", type=Path, default=EMBEDDED_DIR)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        root = args.root
        if args.deb is not None:
            subprocess.run(["dpkg-deb", "-x", str(args.deb), tmp], check=True)
            root = Path(tmp)
        novels = read_novel_lines(root / R_DATA_DIR)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    texts = write_corpus(novels, args.out_dir / EMBEDDED_CORPUS.name)
    train_tokenizer(texts, args.out_dir)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    print(f"wrote {len(texts)} chapters ({n_bytes / 1e6:.2f} MB of text) and a {VOCAB_SIZE}-entry tokenizer "
          f"to {args.out_dir}")


if __name__ == "__main__":
    main()
