"""ZAYA1 under pipeline parallelism equals the one-rank run on the same global batch.

Each stage runs Megatron's own schedule (``get_forward_backward_func``: 1F1B, or the interleaved one with
virtual stages) over the global batch cut into micro-batches, with ``finalize_model_grads_with_balancing``
as the config's finalize hook (as in training): Megatron's gradient finalisation, the tied-embedding
all-reduce between first and last stage included, then the ZAYA1 balancing step of each stage's routers.
Layouts: PP2 (world 2; one layer per stage, so the router state crosses the boundary); PP2 x TP2 with
sequence parallelism and ETP1 (world 4; the stage tensor is split on the sequence dim); PP2 x VP2 on a
4-layer model (world 2; each rank holds two model chunks, layers 0 and 2 or 1 and 3, and the state crosses
three boundaries; with overlapped, unbatched p2p, which Megatron requires for PP2 interleaved).

Checked against the one-rank reference of ``test_zaya_parallel`` (same model, same state): the
per-token losses on the last stage, every gradient on every stage (the last stage's copy of the tied
embedding against the embedding's full gradient), the balancing counts and biases of each router, and that
the last stage's copy of the tied embedding starts equal to the first stage's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
    vp: int | None = None  # virtual stages (model chunks) per rank: the interleaved schedule
    num_layers: int = 2


def global_name(name: str, layer_numbers: dict[int, int], tied: bool) -> str:
    """Local layer ``i`` of this stage is model layer ``layer_numbers[i]`` (1-based); the last stage's copy of
    the tied embedding is the embedding."""
    if tied and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    return re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{layer_numbers[int(m.group(1))] - 1}.",
                  name)


def pipeline_step_worker(rank: int, world: int, layout: PipelineLayout, full_state: dict) -> dict:
    """This rank's model chunks of the ``test`` model, loaded with ``full_state``; one training step through
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
                                 virtual_pipeline_model_parallel_size=layout.vp,
                                 expert_tensor_parallel_size=layout.etp)  # fmt: skip
    model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    cfg = zaya_config("test", use_cpu_initialization=True, params_dtype=torch.float32, skip_mode="identity",
                      tensor_model_parallel_size=layout.tp, sequence_parallel=layout.tp > 1,
                      expert_tensor_parallel_size=layout.etp, pipeline_model_parallel_size=layout.pp,
                      virtual_pipeline_model_parallel_size=layout.vp, num_layers=layout.num_layers,
                      pipeline_dtype=torch.float32,
                      deallocate_pipeline_outputs=True,  # as megatron.training sets it
                      # Megatron's rule for PP2 interleaved: overlapped, unbatched p2p (the two directions between
                      # the same two ranks go through different groups, so they cannot be matched crosswise)
                      overlap_p2p_comm=layout.vp is not None, batch_p2p_comm=layout.vp is None)  # fmt: skip
    chunks = []
    for vp_stage in range(layout.vp or 1):
        vp = vp_stage if layout.vp else None
        chunks.append(build_zaya_model(cfg, pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                                       post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                                       vp_stage=vp))  # fmt: skip
    first, last = chunks[0].pre_process, chunks[-1].post_process
    tied = (chunks[0] if first else chunks[-1]).shared_embedding_or_output_weight().detach().clone() \
        if first or last else None

    chunk_names, layers = [], []
    for model in chunks:
        layer_numbers = {i: layer.layer_number for i, layer in enumerate(model.decoder.layers)}
        layers += [number - 1 for number in layer_numbers.values()]
        names = {n: global_name(n, layer_numbers, model.post_process and not model.pre_process)
                 for n in model.state_dict()}  # fmt: skip
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, tensor in model.state_dict(keep_vars=True).items():
                if not name.endswith("_extra_state"):
                    full = full_state[names[name]]
                    tensor.copy_(shard_of(params[name], name, cfg).of(full) if name in params else full)
        chunk_names.append(names)
    ddps = [DistributedDataParallel(cfg, DistributedDataParallelConfig(), model) for model in chunks]
    for ddp in ddps:
        ddp.train()
    balancing._log = lambda stats: None  # the logging needs megatron.training's global args
    cfg.finalize_model_grads_func = balancing.finalize_model_grads_with_balancing
    reduced_counts = []  # what step_balancing hands each router after its all-reduce
    for router in balancing.routers(chunks):
        update = router.update_balancing_biases
        router.update_balancing_biases = lambda counts, update=update: (reduced_counts.append(counts.clone()),
                                                                         update(counts))  # fmt: skip

    losses = []

    def forward_step(data_iterator, chunk):
        tokens = next(data_iterator)
        labels = tokens[:, 1:].contiguous()
        module = chunk.module
        output = chunk(tokens[:, :-1].contiguous() if module.pre_process else None,
                       labels=labels if module.post_process else None)  # fmt: skip
        if not module.post_process:
            return output, None

        def record_and_reduce(per_token):
            losses.append(per_token.detach().clone())
            return loss_func(torch.ones_like(labels, dtype=torch.float), per_token)

        return output, record_and_reduce

    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=[iter(TOKENS.split(MICRO_BATCH)) for _ in ddps], model=ddps,
        num_microbatches=GLOBAL_BATCH // MICRO_BATCH, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
    )  # fmt: skip

    grads, shards = {}, {}
    for model, names in zip(chunks, chunk_names):
        for name, param in model.named_parameters():
            grads[names[name]] = param.main_grad.clone()
            shards[names[name]] = shard_of(param, name, cfg)
    return {
        "stage": (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        "tied_init": tied,
        "losses": torch.cat(losses) if last else None,
        "grads": grads,
        "shards": shards,
        "layers": layers,
        "reduced_counts": reduced_counts,
        "biases": [router.balancing_biases.clone() for router in balancing.routers(chunks)],
    }


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The one-rank run of the ``test`` model with each number of layers, made when first asked for."""
    made = {}

    def reference(num_layers: int) -> dict:
        if num_layers not in made:
            layout = Layout(dispatcher="allgather", model=(("num_layers", num_layers),))
            (made[num_layers],) = run_ranks(reference_worker, 1, tmp_path_factory.mktemp("reference"), layout, None)
        return made[num_layers]

    return reference


LAYOUTS = {"pp2": PipelineLayout(), "pp2_tp2_sp": PipelineLayout(tp=2),
           "pp2_vp2_interleaved": PipelineLayout(vp=2, num_layers=4)}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_pipeline_equals_one_rank(layout, references, tmp_path):
    reference = references(layout.num_layers)
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
            expected_counts, expected_biases = reference["reduced_counts"][layer], reference["biases"][layer]
            if not torch.equal(counts, expected_counts):
                wrong.append(f"{where} layer {layer} balancing counts {counts} != {expected_counts}")
            if not torch.equal(biases, expected_biases):
                wrong.append(f"{where} layer {layer} biases differ by {(biases - expected_biases).abs().max()}")
    assert not wrong, "\n".join(wrong)
    assert covered == set(reference["grads"])  # every parameter checked on some stage
    assert sum(r["losses"] is not None for r in results) == layout.tp  # the last stage's TP ranks

    # The tied embedding: the last stage's copy starts as the first stage's (same TP rank, same vocab shard).
    tied = {r["stage"]: r["tied_init"] for r in results}
    for tp_rank in range(layout.tp):
        assert torch.equal(tied[(0, tp_rank)], tied[(layout.pp - 1, tp_rank)])
