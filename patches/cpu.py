"""Patch group `cpu` (see registry.py). Filled in by its owner."""
