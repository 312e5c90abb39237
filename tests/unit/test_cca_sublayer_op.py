"""The ``cca_sublayer`` kernel op (ops/cca_sublayer.py), the CCA sublayer up to its attention as one autograd op over
the residual and cca kernels, against the same kernels run op by op (the projections by Megatron's linear layers):
it adds no math, so the losses are bit for bit the same, and every parameter's gradient (into Megatron's ``main_grad``
as trained, accumulated over two micro-batches) but for the rounding of the input's gradient, whose three parts the
projections' GEMMs add up (``op_by_op.assert_same_gradient``), on one sequence and on packed documents, whatever the
layer recomputes. (The per-kernel path itself is checked against the torch references in test_zaya_kernel_glue.py, where
``cca_sublayer`` is among the ops.) Kernels run in Triton's interpreter."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from op_by_op import assert_same_gradient, initial_state, interpret_and_count, ready_calls, trained_step

from megatron_zaya.config import ZayaConfigError, zaya_config
from megatron_zaya.ops import cca_sublayer as cca_sublayer_ops
from megatron_zaya.ops.composite import Piece
from megatron_zaya.pretrained import build_single_process_model

PER_KERNEL = "residual,cca"  # the rest of the model runs its torch references
TOKENS = (2, 6)  # few: the interpreter runs the epilogue's programs, one per token, one after another
# Packed documents, per sequence: lengths 2, 4 and 1, 3, 2.
POSITIONS = torch.tensor([[0, 1, 0, 1, 2, 3], [0, 0, 1, 2, 0, 1]])


@pytest.fixture
def one_op_calls(model_kernels, monkeypatch) -> Counter:
    """The kernels interpreted; counts the ``cca_sublayer`` op's forwards and backwards."""
    return interpret_and_count(monkeypatch, model_kernels, cca_sublayer_ops.CCASublayer)


@pytest.fixture
def pieces(monkeypatch) -> Counter:
    """Counts the pieces the op runs, by kernel: a piece recomputed inside the op runs twice per call."""
    counted = Counter()

    class Counted(Piece):
        def __init__(self, function, *args):
            counted[function.__name__] += 1
            super().__init__(function, *args)

    monkeypatch.setattr(cca_sublayer_ops, "Piece", Counted)
    return counted


@pytest.mark.parametrize("recompute, packed", [((), False), (("layernorm", "cca_qk", "core_attn"), True)],
                         ids=["one-sequence", "recomputed-packed-documents"])
def test_cca_sublayer_op_equals_the_kernels_op_by_op(recompute, packed, one_op_calls, pieces, monkeypatch):
    """With packed documents, off the graph: the op hands its parameters' gradients to DDP itself
    (``training_loop.gradient_ready_calls``); on one sequence to autograd and DDP's hooks."""
    ready = ready_calls(monkeypatch)
    state, positions = initial_state(), POSITIONS if packed else None
    model, losses, grads = trained_step(PER_KERNEL, state, 2, recompute, TOKENS, positions, on_the_graph=not packed)
    assert not any(layer.self_attention.one_op for layer in model.decoder.layers) and not one_op_calls
    model, one_op_losses, one_op_grads = trained_step(PER_KERNEL + ",cca_sublayer", state, 2, recompute, TOKENS,
                                                      positions, on_the_graph=not packed)
    calls = 2 * len(model.decoder.layers)
    assert one_op_calls == {"forward": calls, "backward": calls}  # the op ran in every layer, once each
    # recomputed inside the op: the norm under layernorm, the convolutions and the epilogue under cca_qk
    again = 2 if recompute else 1
    assert pieces == {"RMSNorm": again * calls, "CausalConvs": again * 2 * calls, "QKEpilogue": again * calls,
                      "DelayChannels": calls}
    assert torch.equal(one_op_losses, losses)
    for name, grad in grads.items():
        assert_same_gradient(one_op_grads[name], grad, name)
    assert all(grad.abs().sum() > 0 for name, grad in one_op_grads.items()
               if "self_attention" in name or "input_layernorm" in name)
    assert ready == ({"ready": calls * len(cca_sublayer_ops.CCAWeights._fields)} if packed else {}), ready


def test_cca_sublayer_op_needs_its_pieces_named():
    with pytest.raises(ZayaConfigError, match="--zaya-kernels cca,cca_sublayer,residual"):
        zaya_config("test", kernels="cca,cca_sublayer")


def test_a_layer_the_op_does_not_take_keeps_one_op_per_kernel_and_says_so(caplog):
    model = build_single_process_model(zaya_config("test", kernels=PER_KERNEL + ",cca_sublayer",
                                                   use_cpu_initialization=True, params_dtype=torch.bfloat16,
                                                   fp32_residual_connection=False))
    assert not any(layer.self_attention.one_op for layer in model.decoder.layers)
    said = [r.getMessage() for r in caplog.records if "cca_sublayer op" in r.getMessage()]
    assert said == ["the cca_sublayer op normalises an fp32 residual stream; one op per kernel instead"], said


def test_where_the_kernels_do_not_run_the_layer_keeps_one_op_per_kernel():
    """CPU tensors with the kernels compiled, not interpreted: the layer runs its ops one by one, each of which
    computes its torch reference."""
    model = build_single_process_model(zaya_config("test", kernels=PER_KERNEL + ",cca_sublayer",
                                                   use_cpu_initialization=True, params_dtype=torch.float32))
    layer = model.decoder.layers[0]
    assert layer.self_attention.one_op
    assert not layer.self_attention.runs_as_one_op(torch.zeros(*TOKENS, 64), layer.input_layernorm)


def test_off_the_graph_the_op_tells_ddp_when_its_gradients_are_ready(one_op_calls, monkeypatch):
    """Under ``--overlap-grad-reduce`` DDP reduces a bucket once every parameter's gradient of it is ready: two steps
    (the first records how many ready calls each parameter gets, the second must repeat them) of the test model,
    its layers' CCA parameters off autograd's graph, each step's reduction finished."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ready = ready_calls(monkeypatch)
    cfg = zaya_config("test", num_layers=1, kernels=PER_KERNEL + ",cca_sublayer", use_cpu_initialization=True,
                      params_dtype=torch.float32)
    model = build_single_process_model(cfg)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True)
    ddp = DistributedDataParallel(cfg, ddp_config, model).train()
    ids = torch.randint(0, cfg.vocab_size, TOKENS, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        ddp.zero_grad_buffer()
        ddp(ids, labels=ids).sum().backward()
        ddp.finish_grad_sync()  # fails where a bucket was never reduced or a parameter never said ready
    assert one_op_calls["backward"] == 2 * len(model.decoder.layers)
    assert ready == {"ready": 2 * len(model.decoder.layers) * len(cca_sublayer_ops.CCAWeights._fields)}, ready
