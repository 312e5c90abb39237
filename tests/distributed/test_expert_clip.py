"""``--zaya-expert-clip-grad``: the expert weights' global gradient norm is clipped before Megatron's global clip.

On the ZAYA1 ``test`` model (fp32, CPU, gloo), one optimizer step of Megatron's Adam and of ZayaMuon with the
recipe's hook, at one rank and at EP2 × DP2, against float64 norms of the same gradients gathered from every
rank: the expert norm the hook reports is theirs, the expert gradients end clipped to C, and the global norm
Megatron logs and clips with is that of the dense gradients and the clipped experts. Under the distributed
optimizer (ZeRO-1) the same norms come from the shards.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from gloo import run_ranks
from test_muon_megatron import MUON, global_name, seeded_test_model

EXPERT_CLIP, CLIP = 1e-3, 0.5


def _grads_f64(ddp, ep_rank: int, local_experts: int) -> tuple[float, float]:
    """(dense, expert) gradient norms in float64 over every rank's parameters, each counted once."""
    mine = {global_name(n, ep_rank, local_experts): p.main_grad.double()
            for n, p in ddp.module.named_parameters()}  # fmt: skip
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged = {name: grad for grads in everyone for name, grad in grads.items()}
    dense = sum(g.square().sum().item() for n, g in merged.items() if "experts" not in n)
    expert = sum(g.square().sum().item() for n, g in merged.items() if "experts" in n)
    return math.sqrt(dense), math.sqrt(expert)


def clip_worker(rank: int, world: int, ep: int, optimizer_name: str, distributed: bool = False) -> dict:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig

    import megatron.training.training as training
    from megatron_zaya.optim import recipe
    from megatron_zaya.patches import apply_patches

    apply_patches("cpu,optim,megatron_fixes")
    cfg, model = seeded_test_model(False, ep)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed)
    ddp = DistributedDataParallel(cfg, ddp_config, model)
    config = OptimizerConfig(optimizer=optimizer_name, lr=0.01, clip_grad=CLIP, use_distributed_optimizer=distributed)
    extra = {"muon_config": MUON} if optimizer_name == "zaya_muon" else {}
    optimizer = training.get_megatron_optimizer(config, [ddp], **extra)
    reported = []
    recipe.install(optimizer, expert_clip_grad=EXPERT_CLIP, on_expert_norm=reported.append)

    batch = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(rank))
    ddp.zero_grad_buffer()
    ddp(batch, labels=torch.roll(batch, -1, dims=1)).float().mean().backward()
    finalize_model_grads([ddp])
    ep_rank, local = parallel_state.get_expert_model_parallel_rank(), cfg.num_moe_experts // ep
    # ZeRO-1 reduce-scatters: each rank's buffer holds only its shard reduced (see the test below)
    dense, expert = (None, None) if distributed else _grads_f64(ddp, ep_rank, local)
    success, grad_norm, _ = optimizer.step()
    after = None if distributed else _grads_f64(ddp, ep_rank, local)
    parallel_state.destroy_model_parallel()
    return dict(success=success, reported=reported, grad_norm=grad_norm, dense=dense, expert=expert, after=after)


@pytest.mark.parametrize("world, ep, optimizer_name", [(1, 1, "adam"), (4, 2, "adam"), (4, 2, "zaya_muon")])
def test_expert_norm_is_clipped_before_the_global_clip(tmp_path, world, ep, optimizer_name):
    results = run_ranks(clip_worker, world, tmp_path, ep, optimizer_name)
    for r in results:
        assert r["success"]
        assert r["expert"] > 10 * EXPERT_CLIP and r["dense"] > 2 * CLIP  # both clips act
        assert r["reported"] == [pytest.approx(r["expert"], rel=1e-6)]
        clipped_expert = r["expert"] * EXPERT_CLIP / (r["expert"] + 1e-6)  # C, with Megatron's epsilon
        assert r["grad_norm"] == pytest.approx(math.hypot(r["dense"], clipped_expert), rel=1e-6)
        dense_after, expert_after = r["after"]
        if optimizer_name == "adam":  # the global clip then scales every gradient in place
            scale = CLIP / (r["grad_norm"] + 1e-6)
            assert expert_after == pytest.approx(clipped_expert * scale, rel=1e-5)
            assert math.hypot(dense_after, expert_after) == pytest.approx(CLIP, rel=1e-5)
        else:  # ZayaMuon takes the global clip as a factor: its gradient buffer holds the experts clipped to C
            assert expert_after == pytest.approx(clipped_expert, rel=1e-5)


def test_under_zero1_the_expert_norm_sums_every_shard(tmp_path):
    """The distributed optimizer (EP2 × DP2): each rank clips with the norm of every rank's expert shards, the
    replicated optimizer's norm of the same gradients."""
    (replicated, *_), zero1 = (run_ranks(clip_worker, 4, tmp_path / name, 2, "adam", distributed)
                               for name, distributed in (("replicated", False), ("zero1", True)))
    clipped_expert = replicated["expert"] * EXPERT_CLIP / (replicated["expert"] + 1e-6)
    for r in zero1:
        assert r["success"] and r["reported"] == [pytest.approx(replicated["expert"], rel=1e-5)]
        assert r["grad_norm"] == pytest.approx(math.hypot(replicated["dense"], clipped_expert), rel=1e-5)
