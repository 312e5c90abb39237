"""On a GPU: a training step of the eager single-rank model never waits for the device.

Without CUDA graphs the host launches every kernel of a step; a host-device synchronization inside the step (a
``.item()``, a boolean-mask index, a size read back for a grouped GEMM) stalls the host until the GPU drains,
after which its launches, not the GPU, set the pace. ``torch.cuda.set_sync_debug_mode("error")`` turns each such
wait into an error.

    .venv/bin/python -m pytest -q tests/gpu/test_host_sync_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")


def test_a_forward_and_backward_of_the_eager_model_never_synchronizes():
    from megatron_zaya.config import zaya_config
    from megatron_zaya.pretrained import build_single_process_model

    cfg = zaya_config("test", num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                      kv_channels=64, ffn_hidden_size=512, num_moe_experts=8, vocab_size=8192,
                      max_position_embeddings=1024, use_cpu_initialization=True, params_dtype=torch.bfloat16,
                      bf16=True, kernels="all")
    torch.manual_seed(0)
    model = build_single_process_model(cfg).cuda().train()
    # drawn on the CPU: a CUDA-graph test earlier in this worker can leave the default CUDA generator registered
    # with a graph, and a draw outside capture then fails ("Offset increment outside graph capture")
    ids = torch.randint(0, cfg.vocab_size, (4, 256), generator=torch.Generator().manual_seed(0)).cuda()

    def step():
        loss = model(ids, labels=ids).float().mean()
        loss.backward()
        return loss.detach()

    first = step()  # compiles and tunes the kernels, which may wait for the device
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(first) and torch.isfinite(second)
    torch.testing.assert_close(second, first, rtol=1e-5, atol=0)  # the same batch and weights


def test_megatron_gradient_norm_and_clipping_never_synchronize():
    """Megatron's gradient norm (up to its ``.item()`` of the total) and clipping, as a run without Transformer Engine
    or apex has them (``optim.grad_norm_on_device``), over 300 gradients: the norm of float64, no wait."""
    from megatron.core.optimizer import clip_grads

    from megatron_zaya.patches import applied
    from megatron_zaya.runtime import ensure_single_process_parallel_state

    ensure_single_process_parallel_state()
    if "optim.grad_norm_on_device" not in applied():
        pytest.skip("Transformer Engine or apex gives Megatron its multi-tensor kernels here")
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=gen).cuda() for shape in ((1024, 512), (77,), (3, 5, 7)) * 100]
    want = torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in grads])).item()
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    overflow = torch.zeros(1, dtype=torch.int, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, overflow, [grads], False)
        clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=want)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert norm.item() == pytest.approx(want, rel=1e-5)
    for param, grad in zip(params, grads):
        torch.testing.assert_close(param.grad.double(), grad.double() / (want + 1e-6), rtol=1e-6, atol=0)


def test_master_weight_copies_cast_on_the_gpu_without_a_wait():
    """Megatron's copies of fp32 master weights into bf16 weights (``optim.weight_copies_on_device``), 300 weights
    on the GPU: each the cast of its master, no wait."""
    from megatron.core.optimizer import optimizer

    from megatron_zaya.patches import applied
    from megatron_zaya.runtime import ensure_single_process_parallel_state

    ensure_single_process_parallel_state()
    assert "optim.weight_copies_on_device" in applied()
    gen = torch.Generator().manual_seed(0)
    masters = [torch.randn(shape, generator=gen).cuda() for shape in ((1024, 512), (77,), (3, 5, 7)) * 100]
    weights = [torch.zeros(m.shape, dtype=torch.bfloat16, device="cuda") for m in masters]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        optimizer._multi_tensor_copy_this_to_that(masters, weights, None)  # as bf16 training calls it
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for master, weight in zip(masters, weights):
        assert torch.equal(weight, master.to(torch.bfloat16))
