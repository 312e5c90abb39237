"""A part of the local or in-memory tier read back on a GPU (checkpoint/local_tier.py): onto the device when it fits,
to host memory when its device tensors take more than half the free device memory, which Megatron's merges of
split tensors need beside them. Either way the values are the saved ones, and Megatron's SwiGLU merge of the two
halves of an expert's fc1 runs where they lie.

    python -m pytest -q -m whole_gpu tests/gpu/test_local_tier_gpu.py
"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
              pytest.mark.whole_gpu]  # it fills the device's memory


def _sharded(fc1: torch.Tensor) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    return {"fc1": apply_swiglu_sharded_factory(ShardedTensor.from_rank_offsets("fc1", fc1), ()), "iteration": 7}


def _read_and_merge(part) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    """The part's tensors as read, fc1 as Megatron merges it from them, and the device bytes the read allocated."""
    from megatron_zaya.checkpoint.local_tier import read_part

    before = torch.cuda.memory_allocated()
    state, problems, read = read_part(part)
    assert problems == [] and state is not None
    allocated = torch.cuda.memory_allocated() - before
    shape = torch.empty(8192, 4096, dtype=torch.bfloat16, device="meta")  # what Megatron loads into
    loaded = state.to_state_dict(_sharded(shape), algo="atomic", validate_access_integrity=False)
    assert loaded["iteration"] == 7
    return read.tensors, loaded["fc1"], allocated


def test_a_part_too_large_for_the_free_device_memory_is_read_to_the_host(tmp_path, capsys):
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    from megatron_zaya.checkpoint.local_tier import write_part
    from megatron_zaya.checkpoint.staging import Snapshot
    from megatron_zaya.patches import apply_patches

    apply_patches("checkpointing.local_tier")
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        fc1 = torch.randn(8192, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(0)).bfloat16()
        state, _ = MCoreTensorAwareStateDict.from_state_dict(_sharded(fc1), algo="atomic")
        tensors = state.pop_tensors()
        rest = copy.deepcopy(state)
        assert [t.device.type for t in tensors] == ["cuda", "cuda"]  # the two halves
        write_part(str(tmp_path / "part"), Snapshot(tensors), rest, {"world_size": 1})
        del state, tensors

        halves, merged, allocated = _read_and_merge(tmp_path / "part")
        assert all(h.is_cuda for h in halves) and merged.is_cuda and allocated >= fc1.nbytes
        assert torch.equal(merged, fc1)
        del halves, merged
        assert "read to host memory" not in capsys.readouterr().out

        torch.cuda.empty_cache()  # what the reads left cached counts as free; the driver's free must too
        free = torch.cuda.mem_get_info()[0]
        block = torch.empty(free - 3 * fc1.nbytes // 2, dtype=torch.uint8, device="cuda")  # leaves 1.5 parts free
        halves, merged, allocated = _read_and_merge(tmp_path / "part")
        assert all(not h.is_cuda for h in halves) and not merged.is_cuda and allocated == 0
        assert torch.equal(merged, fc1.cpu())
        out = capsys.readouterr().out
        assert "its 0.1 GiB of device tensors exceed half the device's free" in out and "read to host memory" in out
    finally:
        block = None
        torch.cuda.empty_cache()  # the device back for the tests after this one, in other processes
        torch.distributed.destroy_process_group()
