"""Megatron ``torch_dist`` checkpoints of ZAYA1 models: how they are laid out, verified, saved and resumed from.

* :mod:`.format`: the directory layout, the tracker, the checksums recorded at save.
* :mod:`.integrity`: the files compared with their checksums; the step a tool or a resume loads.
* :mod:`.model_io`: the arguments and architecture a step records; save and load by one process.
* :mod:`.tiers`: background (``--async-save``) saves and the checkpoint-tier flags.
* :mod:`.local_tier`: the node-local tier each rank writes between persistent saves, and the in-memory tier.
* :mod:`.staging`: a rank's tensors written in one pass, through a reusable host pool, checksummed as written.
* :mod:`.peer_copy`: the in-memory tier's copies of each rank's part on another node.
* :mod:`.resume`: a run resumes from its ``--save``; a fresh start into it only when asked.
* :mod:`.save_lock`: one run at a time writes into a ``--save`` directory.
* :mod:`.save_failures`: a ``--save`` that cannot take the next checkpoint, and a save that fails.
* :mod:`.fits`: a checkpoint fits the run that loads it (architecture, optimizer, tokenizer).

How a resume chooses its checkpoint: ``docs/architecture.md``; faults and their tests: ``docs/reliability.md``.
"""

from .format import (CHECKSUMS, TRACKER, check_written, describe_latest_checkpoint, publish_permissions,
                     read_tracker, record_written, recorded_files, step_name, write_checksums)
from .integrity import damage, newest_intact_checkpoint, step_damage, verified_step
from .model_io import architecture_differences, checkpoint_args, load, read_config, save

__all__ = [
    "CHECKSUMS", "TRACKER", "architecture_differences", "check_written", "checkpoint_args", "damage",
    "describe_latest_checkpoint", "load", "newest_intact_checkpoint", "publish_permissions", "read_config",
    "read_tracker", "record_written", "recorded_files", "save", "step_damage", "step_name", "verified_step",
    "write_checksums",
]
