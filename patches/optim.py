"""Patch group `optim` (see registry.py). Filled in by its owner."""
