"""Checkpoint conversion between megatron-zaya and the Hugging Face ``transformers`` ZAYA format."""
