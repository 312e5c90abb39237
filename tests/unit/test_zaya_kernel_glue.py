"""The model's kernel choice wires each kernel with the right arguments: the model built with every kernel op, its
Triton kernels run by Triton's interpreter on CPU, equals the one built with none."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from triton_interpreter import MODEL_KERNELS, install_model_kernels

from megatron_zaya.config import KERNEL_OPS, zaya_config
from megatron_zaya.pretrained import build_single_process_model

ALL_OPS = ",".join(KERNEL_OPS)  # named ops take their kernel functions on any device


@pytest.fixture
def launches(model_kernels, monkeypatch) -> Counter:
    """While the test runs, the model's ops import the interpreted kernel modules; counts the launches of each."""
    counts = Counter()

    @contextlib.contextmanager
    def count(module_name, kernel_name):
        counts[module_name] += 1
        yield

    install_model_kernels(monkeypatch, model_kernels, count)
    return counts


def _pair(**overrides):
    """Two models with the same weights: the torch references, and every kernel op."""
    plain = build_single_process_model(zaya_config("test", kernels="none", **overrides))
    fused = build_single_process_model(zaya_config("test", kernels=ALL_OPS, **overrides))
    fused.load_state_dict(plain.state_dict())
    return plain, fused


def test_kernel_choice_is_made_when_the_model_is_built():
    plain, fused = _pair(use_cpu_initialization=True, params_dtype=torch.float32,
                         moe_token_dispatcher_type="allgather")
    layer, fused_layer = plain.decoder.layers[0], fused.decoder.layers[0]
    assert not plain.fused_lm_head and fused.fused_lm_head
    assert not layer.mlp.experts.grouped and fused_layer.mlp.experts.grouped
    assert layer.self_attention.qk is not fused_layer.self_attention.qk
    assert layer.mlp.router.route_head is not fused_layer.mlp.router.route_head
    assert layer.pre_mlp_layernorm.ops is not fused_layer.pre_mlp_layernorm.ops
    assert not zaya_config("test").uses_kernel("cca")  # "all" on a CPU: the references


@pytest.mark.parametrize("packed", [False, True], ids=["one-sequence", "packed-documents"])
def test_model_with_kernels_equals_torch_path(packed, launches):
    plain, fused = _pair(use_cpu_initialization=True, params_dtype=torch.float32,
                         moe_token_dispatcher_type="allgather", cca_time0=3)
    ids = torch.randint(0, plain.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    # Per sequence: its own document starts, so the RoPE angles differ by sequence too.
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in ([4, 1, 8], [2, 2, 9])])

    def run(net):
        net.train().zero_grad(set_to_none=True)
        loss = net(ids, position_ids=positions if packed else None, labels=ids)
        loss.sum().backward()
        return loss.detach(), {k: p.grad.clone() for k, p in net.named_parameters() if p.grad is not None}

    ref_loss, ref_grads = run(plain)
    assert not launches
    loss, grads = run(fused)
    assert set(launches) == set(MODEL_KERNELS), launches  # every kernel ran, forward and backward
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(ref_grads)
    for key, grad in ref_grads.items():  # a bias's gradient sums terms of the tensor's scale: its rounding is theirs
        torch.testing.assert_close(grads[key], grad, rtol=1e-4, atol=1e-6 * max(1.0, grad.abs().max().item()), msg=key)


def test_checkpoints_interchange_with_and_without_kernels(tmp_path):
    """Kernels change how the model computes, never what it stores: a checkpoint saved with them loads without
    them and the reverse, giving the same logits."""
    from megatron_zaya import checkpoint

    overrides = dict(use_cpu_initialization=True, params_dtype=torch.float32, moe_token_dispatcher_type="allgather")
    cfg = zaya_config("test", kernels="none", **overrides)
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    plain = build_single_process_model(cfg).eval()
    checkpoint.save(plain, cfg, tmp_path / "plain")
    with torch.no_grad():
        expected = plain(ids)

    fused_cfg = zaya_config("test", kernels=ALL_OPS, **overrides)
    fused = build_single_process_model(fused_cfg).eval()
    checkpoint.load(fused, checkpoint.verified_step(tmp_path / "plain"))  # saved without kernels, loaded with them
    with torch.no_grad():
        torch.testing.assert_close(fused(ids), expected)
    checkpoint.save(fused, fused_cfg, tmp_path / "fused")
    assert checkpoint.read_config(checkpoint.verified_step(tmp_path / "fused")).num_layers == cfg.num_layers
    again = build_single_process_model(cfg).eval()
    checkpoint.load(again, checkpoint.verified_step(tmp_path / "fused"))
    for key, tensor in plain.state_dict().items():
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(again.state_dict()[key], tensor), key


def test_all_takes_every_kernel_on_a_gpu_with_or_without_cuda_graphs(monkeypatch):
    """``all``: every kernel op on a GPU, eager or graphed (the fused head and the sublayer ops cut the graphed
    layer's device time too), none on a CPU; named ops are taken on any device."""
    named = zaya_config("test", cuda_graphs=True, kernels="router,router_head")
    assert [named.uses_kernel(op) for op in ("router", "router_head", "moe")] == [True, True, False]
    for gpu in (True, False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda gpu=gpu: gpu)
        for cuda_graphs in (False, True):
            cfg = zaya_config("test", cuda_graphs=cuda_graphs)
            assert [cfg.uses_kernel(op) for op in KERNEL_OPS] == [gpu] * len(KERNEL_OPS), (gpu, cuda_graphs)
