"""Selective recomputation (gradients unchanged, saved bytes down) and the memory planner's formulas, measured
against the tensors a ZAYA1 model really saves for its backward (torch's saved-tensor hooks, CPU, float32)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from zaya_cli import pretrain

from megatron_zaya.config import DEFAULT_RECOMPUTE_MODULES, RECOMPUTE_MODULES, zaya_config
from megatron_zaya.errors import ZayaConfigError
from megatron_zaya.memory_plan import GRAPH_RESERVE_BYTES_PER_HEAD_ELEMENT, Parallel, parameter_counts, stack_bytes
from megatron_zaya.optim.roles import classify
from megatron_zaya.pretrained import build_single_process_model

SHAPES = {"test": (16, 2), "tiny": (32, 3)}  # preset: (sequence, micro-batch)


def _run(preset: str, modules: list[str] | None):
    """Build the model (same seed), one training forward and backward; returns (model, cfg, gradients,
    bytes the layers saved, the routed share of each layer)."""
    kwargs = dict(recompute_granularity="selective", recompute_modules=modules) if modules else {}
    cfg = zaya_config(preset, use_cpu_initialization=True, params_dtype=torch.float32, **kwargs)
    torch.manual_seed(0)
    model = build_single_process_model(cfg)
    model.train()
    seq, batch = SHAPES[preset]
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    state = {p.untyped_storage()._cdata for p in [*model.parameters(), *model.buffers()]}
    inside, saved = [False], {}
    for layer in model.decoder.layers:
        layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))

    def pack(tensor):
        storage = tensor.untyped_storage()
        if inside[0] and storage._cdata not in state:
            saved.setdefault(storage._cdata, storage)  # one storage counted once, however many views are saved
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(ids, position_ids=None, attention_mask=None, labels=ids).float().mean()
    held = sum(storage.nbytes() for storage in saved.values())  # after the forward: dropped outputs count 0
    counts = torch.stack([layer.mlp.router.tokens_per_class for layer in model.decoder.layers])
    routed = (counts[:, :-1].sum(1) / counts.sum(1)).tolist()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return cfg, grads, held, routed


@pytest.fixture(scope="module")
def reference():
    return {preset: _run(preset, None) for preset in SHAPES}


@pytest.mark.parametrize("modules", [[name] for name in RECOMPUTE_MODULES] + [list(DEFAULT_RECOMPUTE_MODULES)])
def test_recomputed_gradients_equal_and_saved_bytes_match_the_formula(reference, modules):
    _, ref_grads, ref_held, _ = reference["test"]
    cfg, grads, held, routed = _run("test", modules)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().clamp_min(1e-30)
        assert (grad - ref_grads[name]).abs().max() <= 1e-6 * scale, name
    seq, batch = SHAPES["test"]
    expected = stack_bytes(cfg, cfg.num_layers, seq * batch, batch, cfg.zaya_recompute_modules, "torch", routed)
    assert held == pytest.approx(expected, abs=8)  # the first layer's 4-byte zero EDA state is not a term
    assert held < ref_held


@pytest.mark.parametrize("preset", list(SHAPES))
def test_formula_matches_the_saved_tensors_at_two_shapes(reference, preset):
    cfg, _, held, routed = reference[preset]
    seq, batch = SHAPES[preset]
    assert held == pytest.approx(stack_bytes(cfg, cfg.num_layers, seq * batch, batch, (), "torch", routed), abs=8)


def test_parameter_counts_match_the_built_model_and_its_optimizer_roles(reference):
    cfg = zaya_config("test", use_cpu_initialization=True, params_dtype=torch.float32)
    model = build_single_process_model(cfg)
    built = {"muon": 0, "adamw": 0}
    for name, param in model.named_parameters():
        built[classify(name, param).optimizer] += param.numel()
    counts = parameter_counts(cfg, Parallel())
    assert counts["muon dense"] + counts["muon expert"] == built["muon"]
    assert counts["adamw dense"] == built["adamw"]


def test_selective_recompute_names_and_graphs():
    with pytest.raises(ZayaConfigError, match="--recompute-modules mlp is not a ZAYA1 piece"):
        zaya_config("test", recompute_granularity="selective", recompute_modules=["mlp"])
    cfg = zaya_config("test", recompute_granularity="selective", recompute_modules=None, cuda_graphs=True)
    assert cfg.zaya_recompute_modules == DEFAULT_RECOMPUTE_MODULES and cfg.recompute_modules == []
    with pytest.raises(ZayaConfigError, match="full recomputation"):
        zaya_config("test", recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                    cuda_graphs=True)


def test_cli_prints_the_plan_and_exits(tmp_path):
    result = pretrain(["--zaya-preset", "zaya1-8b", "--mock-data", "--seq-length", "4096", "--micro-batch-size", "1",
                       "--global-batch-size", "8", "--bf16", "--optimizer", "zaya_muon", "--train-iters", "8",
                       "--zaya-memory-plan", "8", "--use-distributed-optimizer", "--async-save"], tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "DP8, 8.840B parameters" in result.stdout and "largest micro-batch on MI355X" in result.stdout
    assert re.search(r"checkpoint writer +0\.50 GiB", result.stdout)  # --async-save's writer process
    gib = {name: float(value) for name, value in re.findall(r"^  (\S.*?) +([0-9.]+) GiB", result.stdout, re.MULTILINE)}
    params = sum(parameter_counts(zaya_config("zaya1-8b"), Parallel()).values())
    assert abs(gib["master weights"] - 4 * params / 8 / 2**30) < 0.01  # fp32, sharded over the 8 ranks
    state = gib["weights"] + gib["master weights"] + gib["optimizer state"]  # what a background save stages
    pinned = re.search(r"background saves, pinned host memory per node: ([0-9.]+) GiB \(8 GPUs", result.stdout)
    assert pinned and abs(float(pinned.group(1)) - 8 * state) < 0.05, result.stdout
    assert "beside the peak" not in result.stdout  # no device copy
    assert not list(tmp_path.iterdir())  # nothing built, nothing written
    bad = pretrain(["--zaya-preset", "test", "--mock-data", "--zaya-memory-plan", "0"], tmp_path, timeout=300)
    assert bad.returncode == 2 and "--zaya-memory-plan 0" in bad.stderr.strip().splitlines()[-1]


def test_a_cluster_command_is_planned_on_a_machine_without_its_gpus_data_or_tokenizer(tmp_path):
    """The README's 8-GPU command with CUDA graphs, planned for 8 nodes on this CPU machine: its data, tokenizer and
    GPUs exist only on the cluster."""
    cluster = ["--data-path", "/cluster/data/corpus", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
               "/cluster/models/gemma-3-4b-pt"]
    command = ["--zaya-preset", "zaya1-8b", "--seq-length", "4096", "--micro-batch-size", "1", "--global-batch-size",
               "512", "--train-iters", "100000", "--lr", "2e-3", "--min-lr", "2e-4", "--lr-decay-style", "cosine",
               "--lr-warmup-iters", "2000", "--bf16", "--optimizer", "zaya_muon", "--use-distributed-optimizer",
               "--save", "/cluster/ckpt", "--save-interval", "1000", "--zaya-cuda-graphs", "--zaya-memory-plan", "64"]
    result = pretrain(command[:2] + cluster + command[2:], tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "TP1 PP1 EP1 CP1 DP64" in result.stdout
    gib = {name: float(value) for name, value in re.findall(r"^  (\S.*?) +([0-9.]+) GiB", result.stdout, re.MULTILINE)}
    cfg = zaya_config("zaya1-8b")
    tokens = 4096  # micro-batch x sequence
    graphs = (GRAPH_RESERVE_BYTES_PER_HEAD_ELEMENT * cfg.vocab_size * cfg.hidden_size
              + 2 * 4 * (cfg.hidden_size + cfg.router_hidden_size) * tokens)
    assert abs(gib["CUDA graphs"] - graphs / 2**30) < 0.01
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("method, per_chunk", [("uniform", 1), ("uniform", 2), ("block", 1), ("block", 3)])
def test_full_recompute_keeps_what_the_plan_says(method, per_chunk):
    """What the model saves for its backward with full recomputation, against without any: the difference is what
    the plan's activations drop (the recomputed layers' activations, less the inputs each recomputed run keeps),
    the plan adding back the longest run's activations, live while its backward runs. Every token reaches an expert
    (no skip class), as the plan counts them."""
    from megatron_zaya.memory_plan import Run, layer_bytes, plan
    from megatron_zaya.model.recompute import full_recompute_segments

    seq, batch = SHAPES["test"]
    config = dict(num_layers=4, recompute_granularity="full", recompute_method=method, recompute_num_layers=per_chunk)
    held = {}
    for name, extra in (("plain", {}), ("full", config)):
        cfg = zaya_config("test", use_cpu_initialization=True, params_dtype=torch.float32,
                          skip_class=False, **({"num_layers": 4} | extra))
        torch.manual_seed(0)
        model = build_single_process_model(cfg)
        model.train()
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
        state = {p.untyped_storage()._cdata for p in [*model.parameters(), *model.buffers()]}
        inside, saved = [False], {}
        model.decoder.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        model.decoder.register_forward_hook(lambda *_: inside.__setitem__(0, False))

        def pack(tensor):
            storage = tensor.untyped_storage()
            if inside[0] and storage._cdata not in state:
                saved.setdefault(storage._cdata, storage)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(ids, position_ids=None, attention_mask=None, labels=ids)
        held[name] = sum(storage.nbytes() for storage in saved.values())
    run = Run(micro_batch=batch, seq=seq, global_batch=batch, bf16=False, path="torch")
    planned = {name: plan(cfg, Parallel(), dataclasses.replace(run, **fields))["activations per micro-batch"]
               for name, fields in (("plain", {}), ("full", dict(recompute="full", recompute_method=method,
                                                                  recompute_num_layers=per_chunk)))}
    longest = max(len(indices) for indices, again in full_recompute_segments(4, method, per_chunk) if again)
    live = longest * layer_bytes(cfg, seq * batch, batch, (), "torch")
    dropped = held["plain"] - held["full"]
    assert dropped > 0 and dropped == pytest.approx(planned["plain"] - (planned["full"] - live), abs=8)  # EDA's 0
