"""The embedded corpus and tokenizer: exact text round trip, Megatron's tokenizer builder, the cached
dataset, and that build_embedded.py regenerates the shipped tokenizer from the shipped corpus."""

import argparse
import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.training.arguments import add_megatron_arguments
from tokenizers import Tokenizer

from megatron_zaya.data import build_embedded, embedded_tokenizer_dir
from megatron_zaya.data.preprocess import embedded_dataset_prefix

TOKENIZER_DIR = Path(embedded_tokenizer_dir())
REFERENCE = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))


@pytest.fixture(scope="module")
def chapters() -> list[str]:
    with gzip.open(TOKENIZER_DIR / "austen.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


@pytest.fixture(scope="module")
def megatron_tokenizer():
    """Built exactly as `pretrain` does: Megatron's own argument parser, then build_tokenizer(args)."""
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(TOKENIZER_DIR)])
    args.rank = 0  # parse_args() sets it from the environment, after parsing
    return build_tokenizer(args), args


def test_vocabulary_and_special_ids():
    vocab = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(vocab) == 4096
    assert [vocab[t] for t in ("<pad>", "<eos>", "<bos>", "<unk>")] == [0, 1, 2, 3]


def test_text_round_trips_exactly(chapters):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    samples = chapters[::10] + ["  leading spaces,\ttabs\r\nand CRLF", "naïve café — “quotes” 😀 日本語", ""]
    for text in samples:
        ids = hf(text)["input_ids"]
        assert ids == REFERENCE.encode(text).ids  # no BOS/EOS added by the HF wrapper
        assert hf.decode(ids) == text
        assert REFERENCE.decode(ids) == text
    # A tokenizer trained on the corpus compresses it (about 4 characters per token for English).
    assert sum(map(len, chapters)) / sum(len(REFERENCE.encode(c).ids) for c in chapters) > 3.5


def test_megatron_tokenizer_builder_loads_it(megatron_tokenizer, chapters):
    tokenizer, args = megatron_tokenizer
    assert tokenizer.eod == REFERENCE.token_to_id("<eos>")
    assert tokenizer.vocab_size == REFERENCE.get_vocab_size()
    assert args.padded_vocab_size % args.make_vocab_size_divisible_by == 0
    assert args.padded_vocab_size >= tokenizer.vocab_size
    text = chapters[7][:2000]
    assert tokenizer.tokenize(text) == REFERENCE.encode(text).ids
    assert tokenizer.detokenize(tokenizer.tokenize(text)) == text


def test_embedded_dataset_is_built_once(tmp_path, chapters):
    cache = tmp_path / "cache"  # does not exist yet
    prefix = embedded_dataset_prefix(str(cache))
    dataset = IndexedDataset(prefix)
    eos = REFERENCE.token_to_id("<eos>")
    assert len(dataset) == len(chapters)
    for i in (0, len(chapters) // 2, len(chapters) - 1):
        np.testing.assert_array_equal(dataset[i], REFERENCE.encode(chapters[i]).ids + [eos])
    name = os.path.basename(prefix)
    assert sorted(os.listdir(cache)) == [name + ".bin", name + ".idx"]

    stamps = {p: os.stat(p).st_mtime_ns for p in (prefix + ".bin", prefix + ".idx")}
    assert embedded_dataset_prefix(str(cache)) == prefix
    assert {p: os.stat(p).st_mtime_ns for p in stamps} == stamps  # cached, not rewritten


def test_megatron_gpt_dataset_reads_the_embedded_data(tmp_path, chapters, megatron_tokenizer):
    """`--data-path <prefix>` as pretrain uses it: every sample is pieces of chapters joined by EOD."""
    tokenizer, _ = megatron_tokenizer
    config = GPTDatasetConfig(
        random_seed=1234, sequence_length=128, blend=([embedded_dataset_prefix(str(tmp_path))], None),
        split="98,2,0", tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, path_to_cache=str(tmp_path / "index-cache"), mid_level_dataset_surplus=0.005,
    )
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, [8, 2, None], lambda: True, config).build()
    corpus = "\n".join(chapters)
    for sample in (train[0], train[7], valid[1]):
        ids = sample["tokens"].tolist() + sample["labels"][-1:].tolist()
        assert sample["labels"][:-1].tolist() == ids[1:-1]
        pieces = np.split(np.array(ids), np.flatnonzero(np.array(ids) == tokenizer.eod))
        for piece in pieces:
            text = REFERENCE.decode([t for t in piece.tolist() if t != tokenizer.eod])
            assert text in corpus


def test_build_script_regenerates_the_shipped_tokenizer(tmp_path, chapters):
    build_embedded.train_tokenizer(chapters, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (TOKENIZER_DIR / name).read_bytes()


def test_build_script_splits_gutenberg_lines_into_chapters():
    lines = ["TITLE", "", "By Someone", "", "", "CHAPTER I", "", "", "First para", "wrapped here.", "",
             "  Second para.  ", "", "Chapter 2", "", "Last para.", "", "", "THE END"]
    assert build_embedded.chapters(lines) == [
        "CHAPTER I\n\nFirst para wrapped here.\n\nSecond para.",
        "Chapter 2\n\nLast para.",
    ]
