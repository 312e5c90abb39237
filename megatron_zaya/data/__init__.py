"""Data: the embedded default corpus and tokenizer, and `zaya-preprocess` (.txt/.jsonl -> .bin/.idx)."""

from .embedded import embedded_tokenizer_dir

__all__ = ["embedded_tokenizer_dir"]  # the embedded corpus's dataset: preprocess.embedded_dataset_prefix
