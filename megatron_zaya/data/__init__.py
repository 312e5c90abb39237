"""Data: the embedded default corpus and tokenizer, and `zaya-preprocess` (.txt/.jsonl -> .bin/.idx)."""

from .embedded import embedded_dataset_prefix, embedded_tokenizer_dir

__all__ = ["embedded_dataset_prefix", "embedded_tokenizer_dir"]
