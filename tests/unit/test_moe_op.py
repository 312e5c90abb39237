"""The ``moe`` kernel op (ops/moe.py), the MoE sublayer as one autograd op over the router, router_head and experts
kernels, against the same kernels run op by op: it adds no math, so the losses, the router state and the token counts
are bit for bit the same, and the gradients (into Megatron's ``main_grad`` as trained, accumulated over
micro-batches) but for the rounding of the input's gradient, which the router projection's GEMM adds into the
experts' (``op_by_op.assert_same_gradient``), whatever the layer recomputes. (The per-kernel path itself is checked
against the torch references in test_zaya_kernel_glue.py, where ``moe`` is among the ops.) Kernels run in Triton's
interpreter."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from op_by_op import assert_same_gradient, initial_state, interpret_and_count, ready_calls, trained_step

from megatron_zaya.config import ZayaConfigError, zaya_config
from megatron_zaya.ops import moe as moe_ops
from megatron_zaya.pretrained import build_single_process_model

PER_KERNEL = "router,router_head,experts"  # the rest of the model runs its torch references
TOKENS = (2, 7)  # few: the interpreter runs the kernels' programs one after another


@pytest.fixture
def one_op_calls(model_kernels, monkeypatch) -> Counter:
    """The kernels interpreted; counts the ``moe`` op's forwards and backwards."""
    return interpret_and_count(monkeypatch, model_kernels, moe_ops.MoESublayer)


def _trained_step(kernels: str, recompute: tuple[str, ...], skip_mode: str, state: dict, micro_batches: int,
                  on_the_graph: bool):
    """:func:`op_by_op.trained_step`, and each layer's router counts."""
    model, losses, grads = trained_step(kernels, state, micro_batches, recompute, TOKENS, on_the_graph=on_the_graph,
                                        skip_mode=skip_mode)
    return model, losses, grads, [layer.mlp.router.tokens_per_class.clone() for layer in model.decoder.layers]


@pytest.mark.parametrize("recompute, skip_mode, micro_batches, off_graph, norm", [
    (("layernorm", "router"), "zero", 2, True, True), (("moe",), "identity", 1, False, False),
    (("moe",), "zero", 1, False, True)], ids=["norm-recomputed-off-the-graph", "identity-skip-recompute-moe",
                                              "norm-in-the-op-recompute-moe"])
def test_moe_op_equals_the_kernels_op_by_op(recompute, skip_mode, micro_batches, off_graph, norm, one_op_calls,
                                            monkeypatch):
    """Off the graph: the op hands its parameters' gradients to DDP itself (``training_loop.gradient_ready_calls``);
    else to autograd and DDP's hooks. With the ``residual`` kernel (``norm``) and a skipped token giving 0, the op
    also merges the attention's output into the stream and normalises it."""
    ready = ready_calls(monkeypatch)
    state = initial_state()
    kernels = PER_KERNEL + (",residual" if norm else "")
    model, losses, grads, counts = _trained_step(kernels, recompute, skip_mode, state, micro_batches, not off_graph)
    assert not any(layer.mlp.one_op for layer in model.decoder.layers) and not one_op_calls
    model, one_op_losses, one_op_grads, one_op_counts = _trained_step(kernels + ",moe", recompute, skip_mode, state,
                                                                      micro_batches, not off_graph)
    calls = micro_batches * len(model.decoder.layers)
    assert one_op_calls == {"forward": calls, "backward": calls}  # the op ran in every layer, once each
    assert torch.equal(one_op_losses, losses)
    for name, grad in grads.items():
        assert_same_gradient(one_op_grads[name], grad, name)
    assert any(grad.abs().sum() > 0 for name, grad in one_op_grads.items() if ".router." in name)
    layer = model.decoder.layers[0]
    params = [w for w in layer.mlp.router.weights() if w is not None] + [w for ws in layer.mlp.experts.weights()
                                                                          for w in ws]
    if norm and skip_mode == "zero":
        params += [*layer.self_attn_bda.vectors, layer.pre_mlp_layernorm.weight]
    assert ready == ({"ready": calls * len(params)} if off_graph else {}), ready  # each parameter once per call
    for counted, expected in zip(one_op_counts, counts):
        assert torch.equal(counted, expected) and counted.sum() == micro_batches * TOKENS[0] * TOKENS[1]  # once each


def test_moe_op_needs_its_pieces_named():
    with pytest.raises(ZayaConfigError, match="--zaya-kernels experts,moe,router,router_head"):
        zaya_config("test", kernels="experts,moe")


def test_a_layer_the_op_does_not_take_keeps_one_op_per_kernel_and_says_so(caplog):
    model = build_single_process_model(zaya_config("test", kernels=PER_KERNEL + ",moe", skip_class=False,
                                                   use_cpu_initialization=True, params_dtype=torch.float32))
    assert not any(layer.mlp.one_op for layer in model.decoder.layers)
    said = [r.getMessage() for r in caplog.records if "moe op" in r.getMessage()]
    assert said == ["the moe op needs the skip class and the grouped experts; one op per kernel instead"], said


def test_moe_op_on_torch_grouped_mm_equals_the_same_gemms_op_by_op(one_op_calls):
    """The op with its grouped GEMMs on ``torch._grouped_mm`` (as a measured table may choose; fc2's weight gradient
    left on the kernel) against the same GEMMs op by op: one MoE sublayer, with a router state in; its outputs bit
    for bit, the gradients but for the rounding of the input's."""
    import functools

    from megatron_zaya.ops import experts as experts_ops
    from megatron_zaya.ops.grouped_mm import Backends, available

    if not available("cpu", torch.float32):
        pytest.skip("this torch has no torch._grouped_mm on CPU")
    backends = (Backends("torch", "torch", "torch"), Backends("torch", "torch", "triton"))
    model = build_single_process_model(zaya_config("test", kernels=PER_KERNEL + ",moe", use_cpu_initialization=True,
                                                   params_dtype=torch.float32))
    mlp = model.decoder.layers[1].mlp.train()
    mlp.experts.backends, mlp.experts.grouped = backends, functools.partial(experts_ops.fused_experts,
                                                                            backends=backends)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, 2, model.config.hidden_size, generator=gen)
    state_in = torch.randn(9, 2, model.config.router_hidden_size, generator=gen)
    grad_out, grad_state = torch.randn(hidden.shape, generator=gen), torch.randn(state_in.shape, generator=gen)

    def run(one_op: bool):
        mlp.one_op = one_op
        leaves = [hidden.clone().requires_grad_(), state_in.clone().requires_grad_()]
        out, state = mlp(*leaves)
        params = [p for p in mlp.parameters() if p.requires_grad]
        grads = torch.autograd.grad([out, state], leaves + params, [grad_out, grad_state])
        return [out, state, *grads]

    op_by_op, one_op = run(False), run(True)
    assert one_op_calls == {"forward": 1, "backward": 1}
    for i, (got, want) in enumerate(zip(one_op, op_by_op, strict=True)):
        if i < 2:  # the output and the router state
            assert torch.equal(got, want), i
        else:
            assert_same_gradient(got, want, i)
