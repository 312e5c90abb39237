"""The fused LM head under Megatron's DDP (``ops.lm_head.fused_linear_cross_entropy``): the weight kept off autograd's
graph, its gradient added into ``main_grad`` in place, against the weight on the graph (its gradient returned to
autograd and DDP's hook), over two micro-batches, with the output weight tied to the embedding (ZAYA1's) and untied.
The kernels run in Triton's interpreter; the rest of the model runs its torch references."""

from __future__ import annotations

import pytest
import torch
from op_by_op import initial_state, interpret_and_count, ready_calls, trained_step

from megatron_zaya.ops import lm_head


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_lm_head_adds_its_weight_gradient_into_main_grad_off_the_graph(tied, model_kernels, monkeypatch):
    kernel = model_kernels["cross_entropy"]
    calls = interpret_and_count(monkeypatch, model_kernels, kernel._LinearCrossEntropy)
    ready = ready_calls(monkeypatch)
    added = []
    original = lm_head.off_the_graph
    monkeypatch.setattr(lm_head, "off_the_graph", lambda params: added.append(original(params)) or added[-1])
    state = initial_state(tie_embeddings=tied)
    weight_name = "embedding.word_embeddings.weight" if tied else "output_layer.weight"

    _, on_losses, on_grads = trained_step("lm_head", state, 2, on_the_graph=True, tie_embeddings=tied)
    assert added == [False, False] and not ready
    _, off_losses, off_grads = trained_step("lm_head", state, 2, tie_embeddings=tied)
    assert added[2:] == [True, True] and calls == {"forward": 4, "backward": 4}
    # Untied, the op makes the weight's ready call; tied, DDP's hook makes it after the embedding's gradient.
    assert ready == ({} if tied else {"ready": 2}), ready

    assert torch.equal(off_losses, on_losses)
    for name, grad in on_grads.items():
        if name != weight_name:
            assert torch.equal(off_grads[name], grad), name
    # fp32 either way; the two paths round the same sums in another order (tied: the embedding's part added apart)
    torch.testing.assert_close(off_grads[weight_name], on_grads[weight_name], rtol=1e-6, atol=1e-7)
    assert on_grads[weight_name].abs().max() > 1e-3


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_overlapped_gradient_reduction_waits_for_the_lm_head_weight(tied, model_kernels, monkeypatch):
    """Under ``--overlap-grad-reduce`` a bucket's reduction starts once each of its parameters is ready as often as
    in the first iteration, and Megatron asserts that every parameter was: the untied weight, off the graph, needs
    its ready call from the op. Two iterations; each one's gradients equal the weight on the graph's."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_zaya.config import zaya_config
    from megatron_zaya.pretrained import build_single_process_model

    interpret_and_count(monkeypatch, model_kernels, model_kernels["cross_entropy"]._LinearCrossEntropy)
    ready = ready_calls(monkeypatch)
    state = initial_state(tie_embeddings=tied)
    _, _, on_grads = trained_step("lm_head", state, 1, on_the_graph=True, tie_embeddings=tied)

    cfg = zaya_config("test", kernels="lm_head", use_cpu_initialization=True, params_dtype=torch.float32,
                      tie_embeddings=tied)
    model = build_single_process_model(cfg)
    model.load_state_dict(state)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True)
    ddp = DistributedDataParallel(cfg, ddp_config, model).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        ddp.zero_grad_buffer()
        ddp(ids, labels=ids).sum().backward()
        ddp.finish_grad_sync()
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.main_grad, on_grads[name], rtol=1e-6, atol=1e-7, msg=name)
    assert ready == ({} if tied else {"ready": 2})
