"""``--optimizer zaya_muon`` through Megatron-Core on the ZAYA1 model, on CPU with gloo.

The optimizer comes from ``megatron.training.training.get_megatron_optimizer`` (patched by ``optim``),
drives a DDP-wrapped ZAYA1 ``test`` model with Megatron's LR scheduler (warmup + cosine) and gradient
clipping, and is checked against:

* a plain reference written here: Muon on every matrix (value halves apart) and ``torch.optim.AdamW`` on
  the rest, with Megatron's clipping rule and the scheduler's lr / wd (fp32, one rank);
* itself on one rank, from DP2 (fp32 and bf16 with fp32 master weights);
* an uninterrupted run, after a ``torch_dist`` save at DP2 and a load at DP1 (bf16: master weights,
  momentum and Adam moments all come back);
* the saved state itself, after a save at EP2 × DP2 and a load at EP2 × DP4.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.distributed as dist
from gloo import run_ranks

from megatron_zaya.ops.newton_schulz import QUINTIC_COEFFICIENTS
from megatron_zaya.optim import MuonConfig

MUON = MuonConfig(momentum=0.9, ns_dtype=torch.float32, backend="torch")
LR, MIN_LR, WD, CLIP, BETAS, ADAM_EPS = 0.02, 0.002, 0.1, 0.5, (0.9, 0.95), 1e-8
STEPS = 3
BATCH = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))


def build(bf16: bool, ep: int = 1):
    """A DDP-wrapped ZAYA1 ``test`` model, its ChainedOptimizer (via the patched factory) and LR scheduler."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_zaya.patches import apply_patches

    apply_patches("cpu,optim")
    cfg, model = seeded_test_model(bf16, ep)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    return (ddp, *optimizer_and_scheduler(ddp, bf16))


def seeded_test_model(bf16: bool, ep: int = 1):
    """``(config, model)``: the ZAYA1 ``test`` model on this rank's model-parallel groups (TP = PP = 1, EP ``ep``),
    built from seed 0 as every rank and every reference run builds it."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_zaya.config import zaya_config
    from megatron_zaya.model import build_zaya_model

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if bf16 else torch.float32
    cfg = zaya_config("test", use_cpu_initialization=True, params_dtype=dtype, bf16=bf16,
                      moe_token_dispatcher_type="allgather", expert_model_parallel_size=ep)  # fmt: skip
    return cfg, build_zaya_model(cfg)


def optimizer_and_scheduler(ddp, bf16: bool, muon: MuonConfig = MUON):
    """``--optimizer zaya_muon`` from the patched ``get_megatron_optimizer`` for ``ddp``, and Megatron's LR
    scheduler (warmup + cosine) over it."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    import megatron.training.training as training

    config = OptimizerConfig(optimizer="zaya_muon", lr=LR, min_lr=MIN_LR, weight_decay=WD, clip_grad=CLIP,
                             bf16=bf16, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=ADAM_EPS)  # fmt: skip
    optimizer = training.get_megatron_optimizer(config, [ddp], muon_config=muon)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.005, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=2, lr_decay_steps=10,
        lr_decay_style="cosine", start_wd=WD, end_wd=WD, wd_incr_steps=10, wd_incr_style="constant",
    )  # fmt: skip
    return optimizer, scheduler


def compute_grads(ddp, optimizer) -> None:
    from megatron.core.distributed import finalize_model_grads

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    ddp(BATCH, labels=torch.roll(BATCH, -1, dims=1)).float().mean().backward()
    finalize_model_grads([ddp])  # the data-parallel all-reduce


def train_step(ddp, optimizer, scheduler) -> None:
    compute_grads(ddp, optimizer)
    assert optimizer.step()[0]
    scheduler.step(1)


def master_params(ddp) -> dict[str, torch.Tensor]:
    """fp32 values: the master copy where there is one (bf16), else the parameter."""
    return {n: getattr(p, "main_param", p).detach().float().clone() for n, p in ddp.module.named_parameters()}


def global_name(name: str, ep_rank: int, local_experts: int) -> str:
    """``local_experts.i`` of EP rank r is global expert r·local_experts + i."""
    match = re.search(r"local_experts\.(\d+)\.", name)
    if match is None:
        return name
    return name.replace(match.group(0), f"local_experts.{ep_rank * local_experts + int(match.group(1))}.")


def momentum_by_name(ddp, optimizer, ep_rank: int = 0) -> dict[tuple[str, int], torch.Tensor]:
    """ZayaMuon's momentum on this rank, by (global parameter name, slice)."""
    local_experts = ddp.module.config.num_moe_experts // (ddp.module.config.expert_model_parallel_size or 1)
    muons = [o.optimizer for o in optimizer.chained_optimizers if type(o).__name__.startswith("ZayaMuon")]
    found = {}
    for name, param in ddp.module.named_parameters():
        master = getattr(param, "main_param", param)
        for muon in muons:
            for s, value in muon.state.get(master, {}).get("momentum", {}).items():
                found[(global_name(name, ep_rank, local_experts), s)] = value.clone()
    return found


def checkpoint_metadata():
    from megatron.core import parallel_state

    return {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
            "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# The independent reference: plain Muon + torch AdamW, Megatron's clipping, the scheduler's lr and wd.


def plain_newton_schulz(M: torch.Tensor) -> torch.Tensor:
    X = M / (M.norm() + 1e-7)
    transposed = X.shape[0] > X.shape[1]
    X = X.T if transposed else X
    for a, b, c in (QUINTIC_COEFFICIENTS,) * 5:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if transposed else X


class Reference:
    def __init__(self, params: dict[str, torch.Tensor]):
        self.params = {n: p.clone() for n, p in params.items()}
        self.momentum = {n: torch.zeros_like(p) for n, p in params.items() if self.is_matrix(n, p)}
        self.adam_params = {n: torch.nn.Parameter(p.clone()) for n, p in self.params.items() if n not in self.momentum}
        self.adam = torch.optim.AdamW(
            [{"params": [p], "weight_decay": 0.0 if p.dim() == 1 or n.endswith(".bias") else WD}
             for n, p in self.adam_params.items()],
            lr=LR, betas=BETAS, eps=ADAM_EPS,
        )  # fmt: skip

    @staticmethod
    def is_matrix(name: str, param: torch.Tensor) -> bool:
        return param.dim() == 2 and "embedding" not in name

    def step(self, grads: dict[str, torch.Tensor], lr: float) -> None:
        norm = math.sqrt(sum(g.double().pow(2).sum().item() for g in grads.values()))
        clip = min(1.0, CLIP / (norm + 1e-6))
        grads = {n: g * clip for n, g in grads.items()}
        for name, m in self.momentum.items():
            m.mul_(MUON.momentum).add_(grads[name])
            u = grads[name] + MUON.momentum * m
            blocks = u.chunk(2) if name.endswith("linear_v.weight") else [u]
            update = torch.cat([0.2 * math.sqrt(max(b.shape)) * plain_newton_schulz(b) for b in blocks])
            self.params[name] = self.params[name] * (1 - lr * WD) - lr * update
        for group in self.adam.param_groups:
            group["lr"] = lr
        for name, p in self.adam_params.items():
            p.grad = grads[name]
        self.adam.step()
        self.params.update({n: p.detach().clone() for n, p in self.adam_params.items()})


# ---------------------------------------------------------------------------------------------------------
# Workers


def reference_worker(rank: int, world: int) -> dict:
    ddp, optimizer, scheduler = build(bf16=False)
    reference = Reference(master_params(ddp))
    errors = []
    for _ in range(STEPS):
        lr = optimizer.param_groups[0]["lr"]
        compute_grads(ddp, optimizer)
        grads = {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()}
        assert optimizer.step()[0]
        reference.step(grads, lr)
        scheduler.step(1)
        ours = master_params(ddp)
        errors.append(max((ours[n] - reference.params[n]).abs().max().item() for n in ours))
    return {"errors": errors, "kinds": [type(o).__name__ for o in optimizer.chained_optimizers],
            "lrs": [g["lr"] for g in optimizer.param_groups],
            "muon_count": sum(len(g["params"]) for o in optimizer.chained_optimizers
                              if type(o).__name__.startswith("ZayaMuon") for g in o.optimizer.param_groups),
            "matrix_count": sum(Reference.is_matrix(n, p) for n, p in ddp.module.named_parameters())}  # fmt: skip


def train_worker(rank: int, world: int, bf16: bool, steps: int, save_dir: str | None, load_dir: str | None,
                 ep: int = 1) -> dict:
    """``steps`` training steps (after loading ``load_dir``, before saving to ``save_dir``); returns the master
    parameters (local names) and the momentum this rank holds (global names)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.filesystem_async import get_write_results_queue

    get_write_results_queue("fork")  # the checkpoint writer's result queue, forked rather than spawned
    ddp, optimizer, scheduler = build(bf16, ep)
    if load_dir is not None:
        metadata = checkpoint_metadata()
        model_sd = ddp.module.sharded_state_dict(metadata=metadata)
        state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True,
                                                                              metadata=metadata)}  # fmt: skip
        state["scheduler"] = scheduler.state_dict()  # common state: from the checkpoint
        loaded = dist_checkpointing.load(state, load_dir)
        ddp.module.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(loaded["scheduler"])
    for _ in range(steps):
        train_step(ddp, optimizer, scheduler)
    if save_dir is not None:
        metadata = checkpoint_metadata()
        model_sd = ddp.module.sharded_state_dict(metadata=metadata)
        dist_checkpointing.save({"model": model_sd, "scheduler": scheduler.state_dict(),
                                 "optimizer": optimizer.sharded_state_dict(model_sd, metadata=metadata)},
                                save_dir)  # fmt: skip
    dist.barrier()
    return {"params": master_params(ddp), "momentum": momentum_by_name(ddp, optimizer, rank % ep)}


# ---------------------------------------------------------------------------------------------------------
# Tests


def test_one_rank_equals_plain_muon_and_adamw(tmp_path):
    (result,) = run_ranks(reference_worker, 1, tmp_path)
    # Muon and AdamW for the dense parameters, the same pair for the experts (their own optimizer at every EP size)
    assert result["kinds"] == ["ZayaMuonFP32Optimizer", "FP32Optimizer"] * 2
    assert result["muon_count"] == result["matrix_count"] > 0  # every 2-D weight but the embedding
    assert 0.0 < result["lrs"][0] < LR  # the warmup/cosine schedule drove the step sizes
    assert max(result["errors"]) <= 1e-6, result["errors"]


@pytest.mark.parametrize("bf16", [False, True])
def test_data_parallel_equals_one_rank(bf16, tmp_path):
    (single,) = run_ranks(train_worker, 1, tmp_path / "dp1", bf16, STEPS, None, None)
    for result in run_ranks(train_worker, 2, tmp_path / "dp2", bf16, STEPS, None, None):
        for name, value in single["params"].items():
            assert (result["params"][name] - value).abs().max() <= 1e-6, name


def test_checkpoint_saved_at_dp2_resumes_at_dp1(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (uninterrupted,) = run_ranks(train_worker, 1, tmp_path / "full", True, STEPS, None, None)
    run_ranks(train_worker, 2, tmp_path / "save", True, STEPS - 1, str(ckpt), None)
    (resumed,) = run_ranks(train_worker, 1, tmp_path / "load", True, 1, None, str(ckpt))
    for name, value in uninterrupted["params"].items():
        assert (resumed["params"][name] - value).abs().max() <= 1e-6, name


def test_checkpoint_reshards_across_data_parallel_with_experts(tmp_path):
    """Saved at EP2 × DP2 (world 2), loaded at EP2 × DP4 (world 4): the dense matrices' momentum moves from
    two owners to four, the experts' from one owner per expert to two; every master weight and momentum
    tensor comes back where it belongs, held by exactly one rank."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    saved = run_ranks(train_worker, 2, tmp_path / "save", True, STEPS - 1, str(ckpt), None, 2)
    loaded = run_ranks(train_worker, 4, tmp_path / "load", True, 0, None, str(ckpt), 2)

    def merged(results):
        momentum, params = {}, {}
        for rank, result in enumerate(results):
            assert not set(momentum) & set(result["momentum"])  # each matrix's momentum on one rank only
            momentum.update(result["momentum"])
            params.update({global_name(n, rank % 2, 2): v for n, v in result["params"].items()})
        return momentum, params

    (saved_momentum, saved_params), (momentum, params) = merged(saved), merged(loaded)
    assert set(momentum) == set(saved_momentum) and set(params) == set(saved_params)
    assert any("local_experts.3." in name for name, _ in momentum)
    for key, value in momentum.items():
        assert torch.equal(value, saved_momentum[key]), key
    for name, value in params.items():
        assert torch.equal(value, saved_params[name]), name
