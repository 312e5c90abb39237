"""Process set-up for using ZAYA1 models outside a training launcher (conversion, inference, tests)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def ensure_single_process_parallel_state() -> None:
    """Initialise torch.distributed (world size 1) and Megatron's parallel state (all sizes 1) if needed.

    Also applies the patch hooks selected by ``ZAYA_PATCHES`` (on a CPU-only machine that includes the
    ``cpu`` group, which Megatron's model code needs).
    """
    from megatron.core import parallel_state

    from megatron_zaya.patches import apply_patches

    apply_patches()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        # An in-memory store: no port, and no MASTER_ADDR/PORT left in os.environ for child processes (a
        # zaya-pretrain started from this process would inherit the port and fail to bind it).
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
