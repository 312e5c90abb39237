"""Test-only launcher: ``zaya-pretrain``, SIGKILLed once the checksums of checkpoint ITERATION are written and
before ``latest`` names it (the checkpoint is complete on disk, the marker still old).

    python tests/kill_before_tracker.py ITERATION [zaya-pretrain flags]

The fault comes from outside the production code: this wrapper replaces ``write_checksums``, which the tracker
writer calls just before it renames the new marker into place.
"""

import os
import signal
import sys
from pathlib import Path

from megatron_zaya import checkpoint, pretrain

ITERATION = int(sys.argv[1])
_write_checksums = checkpoint.write_checksums


def write_checksums(path):
    _write_checksums(path)
    if Path(path).name == checkpoint.step_name(ITERATION):
        print(f"[test] SIGKILL with the checksums of {path} written, before the tracker", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


checkpoint.write_checksums = write_checksums
sys.exit(pretrain.main(sys.argv[2:]))
