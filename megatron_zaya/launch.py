"""``zaya-torchrun`` (``python -m megatron_zaya.launch``): torchrun, whose exit status after a pre-emption
says whether the job stopped cleanly. Its arguments are torchrun's:

    zaya-torchrun --nproc-per-node 8 -m megatron_zaya.pretrain --zaya-preset zaya1-8b ... --save ckpt

On SIGTERM or SIGINT it passes the signal to the workers and exits 0 when every one of them exited 0 (each
saved its checkpoint); torchrun exits 1 then. Any other outcome is torchrun's: a worker that fails, or one
still running at the end of ``--shutdown-timeout``, makes it exit 1. The patch ``launch.clean_stop_exits_0``
(megatron_zaya/patches/launch.py) says how.

A worker that stops on purpose is not restarted (``launch.no_restart_after_a_stop``), and zaya-torchrun exits with
its code: 2 for bad input (a restart would meet it again), 5 for a crash loop (``--zaya-max-step-failures``), 6 for
a node that failed its self-test.
"""

import sys

from .errors import USAGE_EXIT_CODE
from .patches.registry import apply_patches, resolve
from .training.health import UNHEALTHY_NODE_EXIT_CODE
from .training.ledger import CRASH_LOOP_EXIT_CODE

# The exit codes of a worker that stopped on purpose, and what stopped it.
STOP_CODES = {USAGE_EXIT_CODE: "bad input", CRASH_LOOP_EXIT_CODE: "a crash loop",
              UNHEALTHY_NODE_EXIT_CODE: "a node that failed its self-test"}


def main() -> None:
    selected, _ = resolve(None)  # ZAYA_PATCHES, as the workers read it, can leave the launch group out
    apply_patches(",".join(p.id for p in selected if p.group == "launch") or "none")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun()
    except ChildFailedError as failed:
        codes = [f.exitcode for f in failed.failures.values() if f.exitcode in STOP_CODES]
        if not codes:
            raise
        print(f"zaya-torchrun: a worker stopped on {STOP_CODES[codes[0]]}; not restarted: exit {codes[0]}",
              file=sys.stderr, flush=True)
        sys.exit(codes[0])


if __name__ == "__main__":
    main()
