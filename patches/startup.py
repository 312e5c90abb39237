"""Patch group `startup` (see registry.py). Filled in by its owner."""
