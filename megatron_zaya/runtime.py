"""Process set-up for using ZAYA1 models outside a training launcher (conversion, inference, tests)."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ensure_single_process_parallel_state() -> None:
    """Initialise torch.distributed (world size 1) and Megatron's parallel state (all sizes 1) if needed.

    Also applies the patch hooks selected by ``ZAYA_PATCHES`` (on a CPU-only machine that includes the
    ``cpu`` group, which Megatron's model code needs).
    """
    from megatron.core import parallel_state

    from megatron_zaya.patches import apply_patches

    apply_patches()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
