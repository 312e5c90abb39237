"""The exceptions megatron-zaya raises. Each message is one line: what is wrong and how to fix it."""

from __future__ import annotations

#: The exit code of every command on bad input (argparse's too), which zaya-torchrun does not restart.
USAGE_EXIT_CODE = 2


class UsageError(ValueError):
    """Bad command-line input: a CLI prints it as one line ``<command>: error: ...`` and exits with code 2."""


class InputError(ValueError):
    """An unusable input file of zaya-preprocess: what is wrong, where, and how to fix it (exit code 2)."""


class ZayaConfigError(ValueError):
    """An invalid ZAYA1 configuration."""


class CheckpointError(ValueError):
    """Not a usable ZAYA1 Megatron checkpoint."""


class ConversionError(ValueError):
    """The input is not a ZAYA1 checkpoint the Hugging Face converter understands."""


class PatchError(RuntimeError):
    """A patch that was asked for cannot be applied (target moved, wrong Megatron version, ...)."""


class TrainingFault(RuntimeError):
    """The run stopped on a fault; the message names it, the last good checkpoint and what to do."""


class CrashLoop(TrainingFault):
    """The same step failed in ``--zaya-max-step-failures`` launches in a row: the run stops instead of restarting."""


class UnhealthyNode(TrainingFault):
    """This node failed its self-test before training: the run stops for the node to be left out."""
