"""ZayaMuon over several gloo processes equals the single-rank ZayaMuon.

* DP2 / DP4: every parameter equals the single-rank run, each matrix is orthogonalised exactly once (the
  Newton–Schulz inputs of all ranks together are those of the single rank, each once), and momentum lives
  only on its owner. A tiny all-gather window makes updates straddle windows.
* TP2 × DP2 with EP2 × expert-DP2: column-, row- and GLU-interleaved TP shards, value halves split
  across TP ranks, a TP-sharded 3-D stack, and experts that differ per EP rank.
* torch_dist checkpoint of the momentum saved at DP2 and loaded at DP4, then the run continues exactly.

Every rank derives the same full weights and gradients from fixed seeds (as DDP's all-reduce would leave
them) and keeps its own shard.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from gloo import run_ranks

import megatron_zaya.optim.muon as muon_module
from megatron_zaya.optim import MatrixLayout, MuonConfig, ZayaMuon

CONFIG = MuonConfig(momentum=0.9, ns_dtype=torch.float32, backend="torch", gather_numel=96)
STEPS = 2
TOL = 1e-6

# name: (full shape, layout); a ZAYA1-like mix with enough items for four owners.
DENSE = {
    "linear_q": ((16, 12), MatrixLayout()),
    "linear_v": ((8, 12), MatrixLayout(row_blocks=2)),  # two "heads" of 4 rows: one per TP rank
    "linear_proj": ((12, 16), MatrixLayout()),
    "router_fc1": ((6, 12), MatrixLayout()),
    "router_out": ((5, 6), MatrixLayout()),
    "glu_fc1": ((12, 12), MatrixLayout(row_blocks=2, blocks_per_tp_shard=True)),  # [gate; up]
    "stack": ((3, 10, 12), MatrixLayout(slices=3)),
}
EXPERTS = {  # 4 experts in total: two per EP rank
    **{f"expert{e}_fc1": ((10, 12), MatrixLayout(expert=True)) for e in range(4)},
    "experts_fc2": ((4, 12, 5), MatrixLayout(slices=4, expert=True)),
}
TP_SHARDING = {"linear_q": 0, "linear_v": 0, "linear_proj": 1, "glu_fc1": 0, "stack": 2}  # param dim


def full_tensors(spec: dict, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, (shape, _) in spec.items()}


def shard(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    if tp_size == 1 or name not in TP_SHARDING:
        return full
    if name == "glu_fc1":  # each TP rank holds [its gate rows; its up rows]
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])
    return full.chunk(tp_size, dim=TP_SHARDING[name])[tp_rank]


def expert_shard(name: str, full: torch.Tensor, ep_rank: int, ep_size: int) -> torch.Tensor | None:
    if name == "experts_fc2":
        return full.chunk(ep_size)[ep_rank]
    expert = int(name[len("expert")])
    return full if expert // (4 // ep_size) == ep_rank else None


class Problem:
    """Parameters (local shards), their layouts and per-step gradients for one rank."""

    def __init__(self, spec, local, weight_seed=0):
        self.params = {}
        self.layouts = {}
        for name, full in full_tensors(spec, weight_seed).items():
            tensor = local(name, full)
            if tensor is None:
                continue
            param = torch.nn.Parameter(tensor.clone())
            if name in TP_SHARDING:
                param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, TP_SHARDING[name], 1
            self.params[name] = param
            layout = spec[name][1]
            self.layouts[param] = dataclasses.replace(layout, slices=tensor.shape[0] if tensor.dim() == 3 else 1)
        self.spec, self.local = spec, local

    def set_grads(self, step: int) -> None:
        for name, full in full_tensors(self.spec, 100 + step).items():
            if name in self.params:
                self.params[name].grad = self.local(name, full).clone()


def record_newton_schulz(inputs: list) -> None:
    """From now on, append every matrix ZayaMuon orthogonalises to ``inputs`` (undone by the fixture)."""
    original = muon_module.newton_schulz

    def recording(G, *args, **kwargs):
        inputs.extend(G.clone().unbind(0))
        return original(G, *args, **kwargs)

    muon_module.newton_schulz = recording


def momentum_by_name(optimizer: ZayaMuon, params: dict) -> dict:
    name_of = {id(p): n for n, p in params.items()}
    return {(name_of[id(p)], s): t.clone() for p, st in optimizer.state.items() for s, t in st["momentum"].items()}


# ---------------------------------------------------------------------------------------------------------
# Workers (run in each spawned process)


def dp_worker(rank: int, world: int) -> dict:
    problem = Problem(DENSE, lambda name, full: full)
    ns_inputs: list = []
    record_newton_schulz(ns_inputs)
    optimizer = ZayaMuon([{"params": list(problem.params.values()), "lr": 0.05, "weight_decay": 0.1}],
                         config=CONFIG, layouts=problem.layouts, dp_group=dist.group.WORLD)  # fmt: skip
    for step in range(STEPS):
        problem.set_grads(step)
        optimizer.step()
    names = list(problem.params)
    return {
        "params": {n: p.detach().clone() for n, p in problem.params.items()},
        "momentum": momentum_by_name(optimizer, problem.params),
        "owned": {(names[i.index], i.slice_index) for i in optimizer.owned},
        "loads": [sum(i.flops(5) for i in optimizer.items if i.owner == r) for r in range(world)],
        "biggest": max(i.flops(5) for i in optimizer.items),
        "ns_inputs": ns_inputs,
    }


def tp_ep_worker(rank: int, world: int) -> dict:
    """Ranks 0..3: TP groups {0,1},{2,3}; DP groups {0,2},{1,3}; EP = TP groups; expert-DP = DP groups."""
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_group, dp_group = tp_groups[rank // 2], dp_groups[rank % 2]
    tp_rank = ep_rank = rank % 2

    def tp_local(name, full):
        return shard(name, full, tp_rank, 2)

    def expert_local(name, full):
        return expert_shard(name, full, ep_rank, 2)

    dense, experts = Problem(DENSE, tp_local), Problem(EXPERTS, expert_local, weight_seed=1)
    dense_opt = ZayaMuon(list(dense.params.values()), lr=0.05, weight_decay=0.1, config=CONFIG,
                         layouts=dense.layouts, dp_group=dp_group, tp_group=tp_group)  # fmt: skip
    expert_opt = ZayaMuon(list(experts.params.values()), lr=0.05, weight_decay=0.1, config=CONFIG,
                          layouts=experts.layouts, dp_group=dp_group)  # expert TP = 1  # fmt: skip
    for step in range(STEPS):
        dense.set_grads(step)
        experts.set_grads(step)
        dense_opt.step()
        expert_opt.step()
    return {n: p.detach().clone() for n, p in {**dense.params, **experts.params}.items()}


def checkpoint_worker(rank: int, world: int, ckpt_dir: str, mode: str, start_params: dict | None) -> dict:
    from megatron_zaya.patches import apply_patches

    apply_patches("cpu")  # dist_checkpointing's writer calls torch.cuda on its own
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.filesystem_async import get_write_results_queue

    get_write_results_queue("fork")  # the writer's result queue, forked rather than spawned (seconds faster)

    from megatron_zaya.optim.megatron import momentum_sharded_state

    problem = Problem(DENSE, lambda name, full: full)
    if start_params is not None:
        for name, param in problem.params.items():
            param.data.copy_(start_params[name])
    optimizer = ZayaMuon(list(problem.params.values()), lr=0.05, weight_decay=0.1, config=CONFIG,
                         layouts=problem.layouts, dp_group=dist.group.WORLD)  # fmt: skip
    model_sharded = {  # what a model's sharded_state_dict says about these (DP-replicated) parameters
        pid: ShardedTensor.from_rank_offsets(f"model.{name}", param, replica_id=(0, 0, rank))
        for pid, (name, param) in enumerate(problem.params.items())
    }
    optimizer.init_state()
    sharded = {"momentum": momentum_sharded_state(optimizer, model_sharded)}
    steps = range(STEPS) if mode == "save" else range(STEPS, STEPS + 1)
    if mode == "save":
        for step in steps:
            problem.set_grads(step)
            optimizer.step()
        dist_checkpointing.save(sharded, ckpt_dir)
    else:
        params = list(problem.params.values())
        for pid, entry in dist_checkpointing.load(sharded, ckpt_dir)["momentum"].items():
            for s, tensor in entry["momentum"].items():
                optimizer.state[params[pid]]["momentum"][s].copy_(tensor)
        loaded = momentum_by_name(optimizer, problem.params)
        for step in steps:
            problem.set_grads(step)
            optimizer.step()
    return {
        "params": {n: p.detach().clone() for n, p in problem.params.items()},
        "momentum": momentum_by_name(optimizer, problem.params) if mode == "save" else loaded,
    }


# ---------------------------------------------------------------------------------------------------------
# The single-rank reference


def single_rank(spec, weight_seed=0, steps=STEPS, record=None):
    problem = Problem(spec, lambda name, full: full, weight_seed)
    if record is not None:
        record_newton_schulz(record)
    optimizer = ZayaMuon([{"params": list(problem.params.values()), "lr": 0.05, "weight_decay": 0.1}],
                         config=CONFIG, layouts=problem.layouts)  # fmt: skip
    for step in range(steps):
        problem.set_grads(step)
        optimizer.step()
    return problem.params, momentum_by_name(optimizer, problem.params)


@pytest.fixture(autouse=True)
def _restore_newton_schulz():
    original = muon_module.newton_schulz
    yield
    muon_module.newton_schulz = original


# ---------------------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_equals_single_rank(world, tmp_path):
    reference_inputs: list = []
    reference, reference_momentum = single_rank(DENSE, record=reference_inputs)
    results = run_ranks(dp_worker, world, tmp_path)

    for rank, result in enumerate(results):
        for name, param in reference.items():
            assert (result["params"][name] - param.detach()).abs().max() <= TOL, (rank, name)

    # Momentum only on the owner, every item owned once, values equal to the single rank's.
    owned = [set(r["momentum"]) for r in results]
    assert all(owned[r] == results[r]["owned"] for r in range(world))
    assert sum(len(o) for o in owned) == len(reference_momentum) and set().union(*owned) == set(reference_momentum)
    for r in range(world):
        for key in owned[r]:
            assert (results[r]["momentum"][key] - reference_momentum[key]).abs().max() <= TOL
    loads = results[0]["loads"]
    assert all(load > 0 for load in loads) and max(loads) <= sum(loads) / world + results[0]["biggest"]

    # Each matrix orthogonalised exactly once: all ranks' Newton–Schulz inputs = the single rank's, once each.
    gathered = [m for r in results for m in r["ns_inputs"]]
    assert len(gathered) == len(reference_inputs)
    for matrix in reference_inputs:
        matches = sum(m.shape == matrix.shape and torch.allclose(m, matrix, atol=TOL, rtol=0) for m in gathered)
        assert matches == 1


def test_tensor_expert_and_data_parallel_equal_single_rank(tmp_path):
    dense, _ = single_rank(DENSE)
    experts, _ = single_rank(EXPERTS, weight_seed=1)
    results = run_ranks(tp_ep_worker, 4, tmp_path)
    for rank, result in enumerate(results):
        tp_rank = ep_rank = rank % 2
        for name, param in dense.items():
            expected = shard(name, param.detach(), tp_rank, 2)
            assert (result[name] - expected).abs().max() <= TOL, (rank, name)
        for name, param in experts.items():
            expected = expert_shard(name, param.detach(), ep_rank, 2)
            assert (expected is None) == (name not in result), (rank, name)
            if expected is not None:
                assert (result[name] - expected).abs().max() <= TOL, (rank, name)


def test_momentum_checkpoint_reshards_from_dp2_to_dp4(tmp_path):
    reference, reference_momentum = single_rank(DENSE, steps=STEPS + 1)
    _, momentum_at_save = single_rank(DENSE, steps=STEPS)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    saved = run_ranks(checkpoint_worker, 2, tmp_path, str(ckpt), "save", None)
    loaded = run_ranks(checkpoint_worker, 4, tmp_path, str(ckpt), "load", saved[0]["params"])
    assert sum(len(r["momentum"]) for r in loaded) == len(momentum_at_save)
    for result in loaded:
        for key, value in result["momentum"].items():
            assert (value - momentum_at_save[key]).abs().max() <= TOL, key
        for name, param in reference.items():
            assert (result["params"][name] - param.detach()).abs().max() <= TOL, name
