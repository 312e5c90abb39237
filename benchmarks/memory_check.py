"""The memory planner against a real run: ``python benchmarks/memory_check.py [--nproc N] -- ZAYA_PRETRAIN_FLAGS``.

Prints the plan of ``zaya-pretrain FLAGS --zaya-memory-plan N``, then trains with FLAGS on N GPUs (torchrun when
N > 1) and reads Megatron's last memory report of rank 0 (after the second iteration: the first covers a backward
before the optimizer's state exists): allocated then (the state between steps), and the maximum allocated and
reserved. The last line gives measured / planned for both; the plan is meant to be within 5% of the measured peak. With
``--zaya-cuda-graphs`` the graphs' pool is reserved, not allocated, outside captures: compare the reserved peak.

Example (one H200, ZAYA1-8B)::

    python benchmarks/memory_check.py -- --zaya-preset zaya1-8b --mock-data --seq-length 4096 \\
        --micro-batch-size 1 --global-batch-size 8 --bf16 --optimizer zaya_muon --train-iters 3
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

MIB = 2**20
REPORT = re.compile(r"memory \(MB\) \| allocated: ([0-9.]+) \| max allocated: ([0-9.]+) \| reserved: ([0-9.]+) "
                    r"\| max reserved: ([0-9.]+)")
PLANNED = re.compile(r"^\s+(between steps|peak)\s+([0-9.]+) GiB", re.MULTILINE)


def zaya_pretrain(flags: list[str], nproc: int) -> subprocess.CompletedProcess:
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    return subprocess.run([sys.executable, *launcher, "-m", "megatron_zaya.pretrain", *flags], env=env,
                          capture_output=True, text=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=1, help="GPUs to train on")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="zaya-pretrain flags (after --)")
    args = parser.parse_args(argv)
    flags = [f for f in args.flags if f != "--"]

    plan = zaya_pretrain([*flags, "--zaya-memory-plan", str(args.nproc)], 1)
    if plan.returncode:
        sys.stderr.write(plan.stderr[-3000:])
        return plan.returncode
    print(plan.stdout[plan.stdout.index("[zaya] memory plan"):], flush=True)
    planned = {name: float(gib) for name, gib in PLANNED.findall(plan.stdout)}

    run = zaya_pretrain([*flags, "--log-interval", "1", "--eval-iters", "0"], args.nproc)
    found = REPORT.findall(run.stdout)  # after iterations 1 and 2: the last covers a step with the optimizer's state
    if run.returncode or not found:
        sys.stderr.write((run.stdout + run.stderr)[-5000:])
        print(f"training failed (exit {run.returncode}) or printed no memory report", flush=True)
        return run.returncode or 1
    allocated, max_allocated, _, max_reserved = (float(v) * MIB / 2**30 for v in found[-1])
    print(f"measured (rank 0, GiB): between steps {allocated:.2f}, peak allocated {max_allocated:.2f}, "
          f"peak reserved {max_reserved:.2f}")
    print(f"measured / planned: between steps {allocated / planned['between steps']:.3f}, "
          f"peak allocated {max_allocated / planned['peak']:.3f}, peak reserved {max_reserved / planned['peak']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
