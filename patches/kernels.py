"""Patch group `kernels` (see registry.py). Filled in by its owner."""
