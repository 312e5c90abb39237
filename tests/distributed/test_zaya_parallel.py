"""The ZAYA1 model on two gloo ranks equals the one-rank run on the same global batch.

Layouts of world 2: DP2; TP2 with sequence parallelism (experts tensor-parallel too, ETP2); EP2 with Megatron's
alltoall dispatcher and with ZAYA's sync-free all-gather dispatch (``allgather``, model/moe.py); TP2 + SP with EP2
and ETP1. In each, the per-token losses and
every gradient (after Megatron's DDP reduction, ``finalize_model_grads``) equal the one-rank run's, for
each rank's shard: a TP rank's slice of the full gradient, an EP rank's experts renumbered globally, a DP
rank's half of the batch and the averaged gradient. Every rank also checks the balancing step: the per-class
token counts that ``step_balancing`` all-reduces equal the one-rank counts, and the updated biases equal
the one-rank biases, bit for bit on every rank.

The reference is one rank with the allgather dispatcher (the layouts use alltoall unless named otherwise). It
builds the ``test`` model (float32) with its skip class live (skipped tokens pass through as p·x) and Adam
moments in the balancing state, and every layout loads that full state dict.

Context parallelism (CP2, CP2 x DP2, CP2 x TP2 + SP, on a model whose convolution halo fills a whole chunk and
with a sliding-window layer) has its own reference of that model; each rank holds Megatron's load-balanced
chunks r and 2·cp-1-r of every sequence and compares against the same positions of the one-rank losses.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import pytest
import torch
from gloo import run_ranks

GLOBAL_BATCH, SEQ = 4, 16
TOKENS = torch.randint(0, 512, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
# On each tensor: max |ours - reference| / max |full reference|. The router's gradients are ~100x smaller than
# the rest and sums of cancelling terms: perturbing the one-rank weights at fp32 rounding level (relative 1e-7)
# already moves them by up to 1.1e-5, about as much as TP's different summation order does.
RTOL, ROUTER_RTOL = 1e-5, 5e-5


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallelism; Megatron's default is tp
    dispatcher: str = "alltoall"
    cp: int = 1
    model: tuple = ()  # overrides of the ``test`` preset, as (field, value) pairs


@dataclass(frozen=True)
class Shard:
    """Where a rank's tensor sits in the full one: ``index``-th of ``parts`` chunks along ``dim``.

    ``glu``: a SwiGLU fc1 ``[gate; up]`` split across TP ranks holds ``[its gate rows; its up rows]``.
    """

    dim: int | None = None
    index: int = 0
    parts: int = 1
    glu: bool = False

    def of(self, full: torch.Tensor) -> torch.Tensor:
        if self.dim is None or self.parts == 1:
            return full
        if self.glu:
            return torch.cat([half.chunk(self.parts, self.dim)[self.index] for half in full.chunk(2, self.dim)],
                             self.dim)
        return full.chunk(self.parts, self.dim)[self.index]


def global_name(name: str, ep_rank: int, local_experts: int) -> str:
    """``local_experts.i`` of EP rank r is global expert ``r * local_experts + i``."""
    match = re.search(r"local_experts\.(\d+)\.", name)
    if match is None:
        return name
    return name.replace(match.group(0), f"local_experts.{ep_rank * local_experts + int(match.group(1))}.")


def context_parallel_part(sequences: torch.Tensor, rank: int, cp: int) -> torch.Tensor:
    """CP rank ``rank``'s positions of ``[b, s]``: chunks r and 2·cp-1-r of 2·cp (Megatron's load-balanced
    split, written out here rather than taken from Megatron)."""
    chunks = sequences.chunk(2 * cp, dim=1)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=1)


# ---------------------------------------------------------------------------------------------------------
# The worker: one step of the ZAYA1 model in a layout (world 1 = the reference)


def shard_of(param: torch.Tensor, name: str, cfg) -> Shard:
    from megatron.core import parallel_state as ps

    if not getattr(param, "tensor_model_parallel", False):
        return Shard()
    expert = ".experts." in name  # (``param.allreduce`` marks expert params only when ETP != TP or EP > 1)
    rank, size = ((ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()) if expert
                  else (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()))
    glu = expert and cfg.gated_linear_unit and name.endswith("linear_fc1.weight")
    return Shard(param.partition_dim, rank, size, glu)


def live_balancing_state(model, tokens: torch.Tensor) -> None:
    """Make the reference's balancing state non-trivial: biases ``-mean(p)`` over the batch put every class,
    the skip class too, on an equal footing, so each gets tokens (set layer by layer, since each layer's biases
    change what the next one sees); Adam moments mid-run make the bias step depend on the shares' sizes."""
    from megatron_zaya.ops.router import route_head, route_top1

    routers = [layer.mlp.router for layer in model.decoder.layers]
    heads, logits = [router.route_head for router in routers], []

    def record(scores, *args):
        logits.append(scores.detach())
        return route_top1(scores, *args)

    generator = torch.Generator().manual_seed(1)
    model.eval()  # no token counting
    for index, layer in enumerate(model.decoder.layers):
        logits.clear()
        for router in routers:
            router.route_head = functools.partial(route_head, route_top1=record)
        try:
            model(tokens)
        finally:
            for router, head in zip(routers, heads):
                router.route_head = head
        router = layer.mlp.router
        router.balancing_biases.copy_(-logits[index].softmax(dim=-1).mean(dim=0))
        router.balancing_exp_avg.copy_(0.05 * torch.randn(router.balancing_exp_avg.shape, generator=generator))
        router.balancing_exp_avg_sq.copy_(0.01 * torch.rand(router.balancing_exp_avg_sq.shape, generator=generator))
        router.balancing_step.fill_(3)
    model.train()


def train_step_worker(rank: int, world: int, layout: Layout, full_state: dict | None) -> dict:
    """Build the layout, load ``full_state`` (or make it, on the reference), one forward/backward of this rank's
    part of the global batch, Megatron's grad finalisation, then the balancing step."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_zaya.config import zaya_config
    from megatron_zaya.model import build_zaya_model
    from megatron_zaya.patches import apply_patches
    from megatron_zaya.training.balancing import routers, step_balancing

    apply_patches("cpu")
    ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp, expert_model_parallel_size=layout.ep,
                                 expert_tensor_parallel_size=layout.etp, context_parallel_size=layout.cp)  # fmt: skip
    model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    cfg = zaya_config("test", use_cpu_initialization=True, params_dtype=torch.float32, skip_mode="identity",
                      tensor_model_parallel_size=layout.tp, sequence_parallel=layout.tp > 1,
                      expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp or layout.tp,
                      moe_token_dispatcher_type=layout.dispatcher, context_parallel_size=layout.cp,
                      **{k: list(v) if isinstance(v, tuple) else v for k, v in layout.model})  # fmt: skip
    model = build_zaya_model(cfg)
    local_experts = cfg.num_moe_experts // layout.ep
    ep_rank = ps.get_expert_model_parallel_rank()
    names = {name: global_name(name, ep_rank, local_experts) for name, _ in model.state_dict(keep_vars=True).items()}
    params = dict(model.named_parameters())
    shards = {name: shard_of(params[name], name, cfg) if name in params else Shard() for name in names}
    with torch.no_grad():
        if full_state is None:
            live_balancing_state(model, TOKENS[:, :-1])
            initial_state = {names[n]: t.detach().clone() for n, t in model.state_dict().items()
                             if not n.endswith("_extra_state")}  # fmt: skip
        else:
            for name, tensor in model.state_dict(keep_vars=True).items():
                if not name.endswith("_extra_state"):
                    tensor.copy_(shards[name].of(full_state[names[name]]))

    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(), model)
    ddp.train()
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    tokens = TOKENS.chunk(dp_size)[dp_rank]
    cp_rank = ps.get_context_parallel_rank()
    inputs, labels = (context_parallel_part(t, cp_rank, layout.cp).contiguous()
                      for t in (tokens[:, :-1], tokens[:, 1:]))
    losses = ddp(inputs, labels=labels)  # [b / dp, s / cp]
    losses.mean().backward()
    finalize_model_grads([ddp])

    local_counts = [router.tokens_per_class.clone() for router in routers([model])]
    reduced_counts = []  # what step_balancing hands each router after its all-reduce
    for router in routers([model]):
        update = router.update_balancing_biases
        router.update_balancing_biases = lambda counts, update=update: (reduced_counts.append(counts.clone()),
                                                                         update(counts))  # fmt: skip
    step_balancing([model])

    return {
        "dp": (dp_rank, dp_size),
        "cp": (cp_rank, layout.cp),
        "losses": losses.detach(),
        "grads": {names[n]: p.main_grad.clone() for n, p in model.named_parameters()},  # reduced by DDP
        "shards": {names[n]: shards[n] for n in params},
        "local_counts": local_counts,
        "reduced_counts": reduced_counts,
        "biases": [router.balancing_biases.clone() for router in routers([model])],
        "state": initial_state if full_state is None else None,
    }


# ---------------------------------------------------------------------------------------------------------
# Tests


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    layout = Layout(dispatcher="allgather")
    (result,) = run_ranks(train_step_worker, 1, tmp_path_factory.mktemp("reference"), layout, None)
    counts = torch.stack(result["reduced_counts"])  # [layers, experts + skip]
    assert counts.sum(dim=1).eq(GLOBAL_BATCH * SEQ).all()  # one choice per token
    assert (counts > 0).all(), counts  # every expert and the skip class are in use: a real test of routing
    return result


LAYOUTS = {
    "dp2": Layout(),
    "tp2_sp_etp2_allgather": Layout(tp=2, dispatcher="allgather"),
    "tp2_sp_etp2_alltoall": Layout(tp=2),
    "tp2_sp_etp1_alltoall": Layout(tp=2, etp=1),
    "ep2_alltoall": Layout(ep=2, etp=1),
    "ep2_allgather": Layout(ep=2, etp=1, dispatcher="allgather"),
    "tp2_sp_ep2_etp1": Layout(tp=2, ep=2, etp=1),
}


def relative_error(actual: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """Largest elementwise difference relative to the largest magnitude of the (full) expected tensor."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = expected if scale is None else scale
    return ((actual - expected).abs().max() / scale.abs().max().clamp_min(1e-30)).item()


def assert_equal_to_reference(results: list[dict], reference: dict) -> None:
    """Every rank's losses and gradients equal its part of the one-rank run; the balancing step is the same."""
    wrong, covered = [], set()
    for rank, result in enumerate(results):
        (dp_rank, dp_size), (cp_rank, cp) = result["dp"], result["cp"]
        expected = context_parallel_part(reference["losses"].chunk(dp_size)[dp_rank], cp_rank, cp)
        error = relative_error(result["losses"], expected)
        if not error <= RTOL:
            wrong.append(f"rank {rank} per-token losses: relative error {error:.2e}")
        for name, grad in result["grads"].items():
            full = reference["grads"][name]
            error = relative_error(grad, result["shards"][name].of(full), scale=full)
            if not error <= (ROUTER_RTOL if ".router." in name else RTOL):
                wrong.append(f"rank {rank} {name}: relative error {error:.2e}")
            covered.add(name)
    assert not wrong, "\n".join(wrong)
    assert covered == set(reference["grads"])  # every global parameter (every expert) checked somewhere

    # Balancing: the counts step_balancing sums equal the one-rank counts (every rank routed its own tokens:
    # DP, CP and sequence-parallel TP split them, and together they make up the global batch), and every rank
    # takes the one-rank bias step, bit for bit.
    for layer, expected in enumerate(reference["reduced_counts"]):
        assert torch.equal(sum(r["local_counts"][layer] for r in results), expected)
    for result in results:
        for counts, expected in zip(result["reduced_counts"], reference["reduced_counts"], strict=True):
            assert torch.equal(counts, expected), (counts, expected)
        for biases, expected in zip(result["biases"], reference["biases"], strict=True):
            assert torch.equal(biases, expected), (biases - expected).abs().max()


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_two_ranks_equal_one_rank(layout, reference, tmp_path):
    assert_equal_to_reference(run_ranks(train_step_worker, 2, tmp_path, layout, reference["state"]), reference)


# Context parallelism: halos longer than one token, sliding windows, and chunks 4 tokens long (SEQ 16 / 2·cp),
# so that the convolution halo (cca_time0 + cca_time1 - 2 = 4) is a whole chunk.
CONTEXT_MODEL = (("cca_time0", 3), ("cca_time1", 3), ("attention_types", ("sliding", "global")),
                 ("sliding_window", 6))  # fmt: skip
CONTEXT_LAYOUTS = {"cp2": (2, Layout(cp=2, model=CONTEXT_MODEL)),
                   "cp2_dp2": (4, Layout(cp=2, model=CONTEXT_MODEL)),
                   "cp2_tp2_sp_etp1": (4, Layout(cp=2, tp=2, etp=1, model=CONTEXT_MODEL))}  # fmt: skip


@pytest.fixture(scope="module")
def context_reference(tmp_path_factory):
    layout = Layout(dispatcher="allgather", model=CONTEXT_MODEL)
    (result,) = run_ranks(train_step_worker, 1, tmp_path_factory.mktemp("context-reference"), layout, None)
    return result


@pytest.mark.parametrize("world, layout", CONTEXT_LAYOUTS.values(), ids=CONTEXT_LAYOUTS.keys())
def test_context_parallel_equals_one_rank(world, layout, context_reference, tmp_path):
    results = run_ranks(train_step_worker, world, tmp_path, layout, context_reference["state"])
    assert_equal_to_reference(results, context_reference)
