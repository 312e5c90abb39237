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
