"""The node self-test every rank runs before training, at each launch and so after each restart: a GEMM against
a float64 reference, a write and read-back of device memory, and (local rank 0, once per node) the uncorrectable
ECC error counters of ``nvidia-smi`` or ``amd-smi``/``rocm-smi``, where one of them is installed. On a machine
without a GPU the GEMM and the memory check run on the CPU. It takes about a second.

A failing node is named in one line and recorded in the event ledger (``node_excluded``); the rank exits with
:data:`UNHEALTHY_NODE_EXIT_CODE`, on which zaya-torchrun does not restart the group, and the Slurm scripts requeue
the job without the node (examples/slurm/lib.sh). ``--zaya-no-self-test`` turns it off.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import torch

from ..errors import UnhealthyNode
from .ledger import LEDGER, node_name

UNHEALTHY_NODE_EXIT_CODE = 6
GEMM_SIZE = 512
GEMM_TOLERANCE = 1e-2  # relative Frobenius error; TF32 or a reordered sum stays near 1e-3, a broken unit far above
# On a CPU the check exercises its code, not the host's RAM: 8 MiB take 0.03 s of each rank's start, 64 MiB took 0.27 s.
MEMORY_BYTES = {"cpu": 8 << 20, "cuda": 1 << 30}
TOOL_SECONDS = 20


def _device_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


def gemm_problem(device: torch.device) -> str | None:
    """A float32 GEMM on ``device`` compared with the float64 product on the CPU."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(GEMM_SIZE, GEMM_SIZE, generator=generator, dtype=torch.float64) for _ in range(2))
    product = _device_gemm(a.float().to(device), b.float().to(device)).double().cpu()
    reference = a @ b
    error = (torch.linalg.norm(product - reference) / torch.linalg.norm(reference)).item()
    if not error <= GEMM_TOLERANCE:  # also NaN
        return f"a {GEMM_SIZE}x{GEMM_SIZE} float32 GEMM is off its float64 reference by {error:.3g} (relative)"
    return None


def memory_problem(device: torch.device) -> str | None:
    """Fill device memory with a pattern and its complement, and read both back."""
    count = MEMORY_BYTES[device.type if device.type in MEMORY_BYTES else "cuda"] // 8
    pattern = torch.arange(count, dtype=torch.int64, device=device) * 0x5851F42D4C957F2D  # every bit varies
    for expected in (pattern, ~pattern):
        written = expected.clone()
        wrong = int((written != expected).sum())
        if wrong:
            return f"{wrong} of {count} 8-byte words of device memory read back other than written"
    return None


def _run(command: list[str]) -> str | None:
    """The output of a monitoring tool, or None where it is not installed or fails."""
    if shutil.which(command[0]) is None:
        return None
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TOOL_SECONDS)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _uncorrectable(value, path: str = "") -> dict[str, int]:
    """The counters under keys naming uncorrectable errors in a tool's JSON, by their path."""
    found = {}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        where = f"{path}/{key}"
        if isinstance(item, (dict, list)):
            found.update(_uncorrectable(item, where))
        elif "uncorrect" in str(key).lower() and str(item).strip().isdigit():
            found[where] = int(str(item).strip())
    return found


def _amd_smi_uncorrectable(document) -> list[tuple[str, int]]:
    """``(GPU, count)`` of ``amd-smi metric --ecc --json``: a list of GPUs (ROCm 6) or ``{"gpu_data": [...]}``
    (ROCm 7), each with ``ecc.total_uncorrectable_count``, "N/A" where unsupported. The per-block counters
    (``ecc_blocks``) are parts of that total, so they are not added to it."""
    gpus = document.get("gpu_data", []) if isinstance(document, dict) else document
    found = []
    for index, gpu in enumerate(gpus if isinstance(gpus, list) else []):
        ecc = gpu.get("ecc") if isinstance(gpu, dict) else None
        count = str(ecc.get("total_uncorrectable_count", "")).strip() if isinstance(ecc, dict) else ""
        if count.isdigit():
            found.append((str(gpu.get("gpu", index)), int(count)))
    return found


def ecc_problems() -> list[str]:
    """The GPUs of this node with uncorrectable ECC errors since the driver loaded, from whichever tool exists."""
    problems = []
    nvidia = _run(["nvidia-smi", "--query-gpu=index,ecc.errors.uncorrected.volatile.total",
                   "--format=csv,noheader,nounits"])
    for line in (nvidia or "").splitlines():
        index, _, count = (part.strip() for part in line.partition(","))
        if count.isdigit() and int(count):
            problems.append(f"GPU {index} has {count} uncorrectable ECC errors (nvidia-smi)")
    amd = _run(["amd-smi", "metric", "--ecc", "--json"])
    rocm = None if amd is not None else _run(["rocm-smi", "--showrasinfo", "all", "--json"])
    try:
        if amd is not None:
            problems += [f"GPU {gpu} has {count} uncorrectable ECC errors (amd-smi)"
                         for gpu, count in _amd_smi_uncorrectable(json.loads(amd)) if count]
        elif rocm is not None:
            problems += [f"{where.lstrip('/')} = {count} (rocm-smi)"
                         for where, count in _uncorrectable(json.loads(rocm)).items() if count]
    except ValueError:  # not JSON (an older tool without --json): no reading rather than a wrong one
        pass
    return problems


def self_test(device: torch.device, check_ecc: bool) -> list[str]:
    """What is wrong with this rank's device (and, with ``check_ecc``, this node's GPUs); empty when healthy."""
    problems = [p for p in (gemm_problem(device), memory_problem(device)) if p]
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return problems + (ecc_problems() if check_ecc else [])


def check_this_node() -> None:
    """Run :func:`self_test` on this rank's device; a failure is recorded in the ledger and raises
    :class:`UnhealthyNode`."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    problems = self_test(device, check_ecc=local_rank == 0)
    if not problems:
        return
    node, rank = node_name(), os.environ.get("RANK", "0")
    cause = "; ".join(problems)
    LEDGER.record("node_excluded", cause=f"self-test of rank {rank} ({device}): {cause}")
    raise UnhealthyNode(f"node {node} failed its self-test on rank {rank} ({device}): {cause}; it is recorded in the "
                        f"event ledger {LEDGER.path or '(none: no --save)'}, for the Slurm scripts to requeue the job "
                        f"without it (exit {UNHEALTHY_NODE_EXIT_CODE}); --zaya-no-self-test skips the test")
