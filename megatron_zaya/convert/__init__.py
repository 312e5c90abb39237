"""Checkpoint conversion between megatron-zaya and the Hugging Face ``transformers`` ZAYA format."""


class ConversionError(ValueError):
    """The input is not a ZAYA1 checkpoint this converter understands; the message says why and what to do."""
