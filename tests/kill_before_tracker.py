"""Test-only launcher: ``zaya-pretrain``, SIGKILLed once the checksums of checkpoint ITERATION are written and
before ``latest`` names it (the checkpoint is complete on disk, the marker still old).

    python tests/kill_before_tracker.py ITERATION [zaya-pretrain flags]

The fault comes from outside the production code: this wrapper replaces ``write_checksums`` of
``megatron_zaya.checkpoint.format``, which the tracker writer calls just before it renames the new marker into place.
"""

import os
import signal
import sys
from pathlib import Path

from megatron_zaya import pretrain
from megatron_zaya.checkpoint import format as checkpoint_format


def kill_after(iteration: int, write_checksums):
    def wrapped(path):
        write_checksums(path)
        if Path(path).name == checkpoint_format.step_name(iteration):
            print(f"[test] SIGKILL with the checksums of {path} written, before the tracker", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    return wrapped


if __name__ == "__main__":  # (spawned helpers re-import this file as __mp_main__)
    checkpoint_format.write_checksums = kill_after(int(sys.argv[1]), checkpoint_format.write_checksums)
    sys.exit(pretrain.main(sys.argv[2:]))
