"""megatron-zaya: Zyphra's ZAYA1 mixture-of-experts models on Megatron-Core (ROCm and CUDA)."""

__version__ = "0.1.0"


def load_pretrained(path, dtype=None, device=None):
    """A ready ZAYA1 model from a Hugging Face directory or a Megatron checkpoint (see ``pretrained``)."""
    from .pretrained import load_pretrained as _load

    return _load(path, dtype=dtype, device=device)


__all__ = ["load_pretrained", "__version__"]
