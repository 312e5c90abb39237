"""Benchmarks of megatron-zaya: run each one from the repository root as ``python -m benchmarks.<name>``.

Their figures, with GPU, command, baseline and date, are in ``docs/benchmarks.md``; ``benchmarks/README.md``
lists what each module measures.
"""
