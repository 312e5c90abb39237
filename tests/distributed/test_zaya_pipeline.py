"""ZAYA1 under pipeline parallelism equals the one-rank run on the same global batch (issue #4, item 5).

Each stage runs Megatron's own 1F1B schedule (``get_forward_backward_func``) over the global batch cut into
micro-batches, with ``finalize_model_grads_with_balancing`` as the config's finalize hook (as in training):
Megatron's gradient finalisation, the tied-embedding all-reduce between first and last stage included,
then the ZAYA1 balancing step of each stage's routers. Layouts: PP2 (world 2; one layer per stage, so the
router state crosses the boundary) and PP2 x TP2 with sequence parallelism and ETP1 (world 4; the stage tensor
is split on the sequence dim).

Checked against the one-rank reference of ``test_zaya_parallel`` (same ``test`` model, same state): the
per-token losses on the last stage, every gradient on every stage (the last stage's copy of the tied
embedding against the embedding's full gradient), the balancing counts and biases of each router, and that
the last stage's copy of the tied embedding starts equal to the first stage's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial

import pytest
import torch
from gloo import run_ranks
from test_zaya_parallel import GLOBAL_BATCH, ROUTER_RTOL, RTOL, SEQ, TOKENS, Layout, relative_error, shard_of
from test_zaya_parallel import train_step_worker as reference_worker

MICRO_BATCH = 1  # four micro-batches: 1F1B runs warm-up, steady state and cool-down


@dataclass(frozen=True)
class PipelineLayout:
    pp: int = 2
    tp: int = 1
    etp: int = 1  # the alltoall dispatcher (the CLI's) with experts not tensor-parallel, as on one rank


def global_name(name: str, layer_numbers: dict[int, int], tied: bool) -> str:
    """Local layer ``i`` of this stage is model layer ``layer_numbers[i]`` (1-based); the last stage's copy of
    the tied embedding is the embedding."""
    if tied and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    return re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{layer_numbers[int(m.group(1))] - 1}.",
                  name)


def pipeline_step_worker(rank: int, world: int, layout: PipelineLayout, full_state: dict) -> dict:
    """This rank's stage of the ``test`` model, loaded with ``full_state``; one training step through
    Megatron's pipeline schedule."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_zaya.config import zaya_config
    from megatron_zaya.model import build_zaya_model
    from megatron_zaya.patches import apply_patches
    from megatron_zaya.training import balancing
    from megatron_zaya.training.steps import loss_func

    apply_patches("cpu,pipeline")
    ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                                 expert_tensor_parallel_size=layout.etp)  # fmt: skip
    model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    cfg = zaya_config("test", use_cpu_initialization=True, params_dtype=torch.float32, skip_mode="identity",
                      tensor_model_parallel_size=layout.tp, sequence_parallel=layout.tp > 1,
                      expert_tensor_parallel_size=layout.etp, pipeline_model_parallel_size=layout.pp,
                      pipeline_dtype=torch.float32,
                      deallocate_pipeline_outputs=True)  # as megatron.training sets it  # fmt: skip
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    model = build_zaya_model(cfg, pre_process=first, post_process=last)
    tied = model.shared_embedding_or_output_weight().detach().clone() if first or last else None

    layer_numbers = {i: layer.layer_number for i, layer in enumerate(model.decoder.layers)}
    names = {n: global_name(n, layer_numbers, last and not first) for n in model.state_dict()}
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if not name.endswith("_extra_state"):
                full = full_state[names[name]]
                tensor.copy_(shard_of(params[name], name, cfg).of(full) if name in params else full)

    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(), model)
    ddp.train()
    balancing._log = lambda stats: None  # the logging needs megatron.training's global args
    cfg.finalize_model_grads_func = balancing.finalize_model_grads_with_balancing
    cfg.no_sync_func = ddp.no_sync
    reduced_counts = []  # what step_balancing hands each router after its all-reduce
    for router in balancing.routers([model]):
        update = router.update_balancing_biases
        router.update_balancing_biases = lambda counts, update=update: (reduced_counts.append(counts.clone()),
                                                                         update(counts))  # fmt: skip

    losses = []

    def forward_step(data_iterator, stage):
        tokens = next(data_iterator)
        labels = tokens[:, 1:].contiguous()
        output = stage(tokens[:, :-1].contiguous() if first else None, labels=labels if last else None)
        if not last:
            return output, None

        def record_and_reduce(per_token):
            losses.append(per_token.detach().clone())
            return loss_func(torch.ones_like(labels, dtype=torch.float), per_token)

        return output, record_and_reduce

    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(TOKENS.split(MICRO_BATCH)), model=[ddp],
        num_microbatches=GLOBAL_BATCH // MICRO_BATCH, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
    )  # fmt: skip

    return {
        "stage": (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        "tied_init": tied,
        "losses": torch.cat(losses) if last else None,
        "grads": {names[n]: p.main_grad.clone() for n, p in model.named_parameters()},
        "shards": {names[n]: shard_of(p, n, cfg) for n, p in params.items()},
        "layers": [number - 1 for number in layer_numbers.values()],
        "reduced_counts": reduced_counts,
        "biases": [router.balancing_biases.clone() for router in balancing.routers([model])],
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    (result,) = run_ranks(reference_worker, 1, tmp_path_factory.mktemp("reference"), Layout(dispatcher="allgather"),
                          None)  # fmt: skip
    return result


LAYOUTS = {"pp2": PipelineLayout(), "pp2_tp2_sp": PipelineLayout(tp=2)}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_pipeline_equals_one_rank(layout, reference, tmp_path):
    results = run_ranks(pipeline_step_worker, layout.pp * layout.tp, tmp_path, layout, reference["state"])

    wrong, covered = [], set()
    for result in results:
        stage, tp_rank = result["stage"]
        where = f"stage {stage} TP rank {tp_rank}"
        if result["losses"] is not None:
            error = relative_error(result["losses"], reference["losses"])
            if not error <= RTOL:
                wrong.append(f"{where} per-token losses: relative error {error:.2e}")
        for name, grad in result["grads"].items():
            full = reference["grads"][name]
            error = relative_error(grad, result["shards"][name].of(full), scale=full)
            if not error <= (ROUTER_RTOL if ".router." in name else RTOL):
                wrong.append(f"{where} {name}: relative error {error:.2e}")
            covered.add(name)
        for layer, counts, biases in zip(result["layers"], result["reduced_counts"], result["biases"], strict=True):
            if not torch.equal(counts, reference["reduced_counts"][layer]):
                wrong.append(f"{where} layer {layer} balancing counts {counts} != {reference['reduced_counts'][layer]}")
            if not torch.equal(biases, reference["biases"][layer]):
                wrong.append(f"{where} layer {layer} biases differ by {(biases - reference['biases'][layer]).abs().max()}")
    assert not wrong, "\n".join(wrong)
    assert covered == set(reference["grads"])  # every parameter checked on some stage
    assert sum(r["losses"] is not None for r in results) == layout.tp  # the last stage's TP ranks

    # The tied embedding: the last stage's copy starts as the first stage's (same TP rank, same vocab shard).
    tied = {r["stage"]: r["tied_init"] for r in results}
    for tp_rank in range(layout.tp):
        assert torch.equal(tied[(0, tp_rank)], tied[(layout.pp - 1, tp_rank)])
