"""Patch hooks: what megatron-zaya changes in Megatron-Core and torch, and why (see ``registry``)."""

from .registry import REGISTRY, Patch, PatchError, applied, apply_patches, register

__all__ = ["REGISTRY", "Patch", "PatchError", "applied", "apply_patches", "register"]
