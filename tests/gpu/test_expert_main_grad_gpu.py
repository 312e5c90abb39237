"""On a GPU, under Megatron's DDP: the grouped experts' weight gradients, accumulated by the kernel (or after
``torch._grouped_mm``) straight into ``main_grad``, equal the unfused path's (a bf16 gradient that the DDP hooks
add), over two micro-batches and two steps. (With the layers replayed as CUDA graphs, the same accumulation is
checked through the CLI, bit for bit against eager layers: ``test_cuda_graphs_gpu.py``.)"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")


def _ddp_model():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_zaya.config import zaya_config
    from megatron_zaya.pretrained import build_single_process_model

    cfg = zaya_config("test", num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                      kv_channels=64, ffn_hidden_size=512, num_moe_experts=8, vocab_size=4096,
                      max_position_embeddings=1024, use_cpu_initialization=True, params_dtype=torch.bfloat16,
                      bf16=True)
    torch.manual_seed(0)
    model = build_single_process_model(cfg).cuda().train()
    ddp = DistributedDataParallel(config=cfg, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                  module=model)
    return ddp, model


def _expert_main_grads(ddp, model, batches):
    ddp.zero_grad_buffer()
    for ids in batches:
        ddp(ids, labels=ids).float().mean().backward()
    return {name: p.main_grad.float().clone() for name, p in model.named_parameters() if "local_experts" in name}


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fused_expert_gradients_equal_unfused(backend, monkeypatch):
    """The Triton kernel's weight gradients (added in fp32), and ``torch._grouped_mm``'s (bf16, then added), where
    the model is built to run every GEMM of its experts there (ops/grouped_mm.py)."""
    from megatron_zaya.kernels import grouped_gemm
    from megatron_zaya.ops import grouped_mm

    if backend == "torch":
        if not grouped_mm.available("cuda", torch.bfloat16):
            pytest.skip("this torch has no torch._grouped_mm here")
        chosen = grouped_mm.Backends("torch", "torch", "torch")
        monkeypatch.setattr(grouped_mm, "choose_backends", lambda dtype, shapes: [chosen for _ in shapes])
    generator = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, 4096, (2, 256), device="cuda", generator=generator) for _ in range(2)]
    fused_ddp, fused_model = _ddp_model()
    plain_ddp, plain_model = _ddp_model()
    chosen_backends = getattr(fused_model.decoder.layers[0].mlp.experts.grouped, "keywords", {}).get("backends")
    assert (chosen_backends is not None) == (backend == "torch")  # built with torch's GEMMs, or the kernel alone
    plain_model.load_state_dict(fused_model.state_dict())
    for step in range(2):
        fused = _expert_main_grads(fused_ddp, fused_model, batches)
        monkeypatch.setitem(grouped_gemm.ACCUMULATE_INTO_MAIN_GRAD, "enabled", False)
        plain = _expert_main_grads(plain_ddp, plain_model, batches)
        monkeypatch.setitem(grouped_gemm.ACCUMULATE_INTO_MAIN_GRAD, "enabled", True)
        assert fused.keys() == plain.keys() and len(fused) == 2 * 2 * 8
        for name, want in plain.items():
            error = ((fused[name] - want).norm() / want.norm().clamp_min(1e-12)).item()
            assert error <= 1e-2, (step, name, error)  # bf16 rounding of the unfused gradient
