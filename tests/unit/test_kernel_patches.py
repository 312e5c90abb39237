"""The ``kernels`` patch group: registration, and that each patch wires its kernel where Megatron looks."""

import pytest
import torch

import megatron_zaya.patches.kernels  # noqa: F401  (registers the group, whichever test runs first)
from megatron_zaya.patches.registry import REGISTRY, skip_reason

KERNEL_PATCHES = ["kernels.swiglu", "kernels.cross_entropy", "kernels.weight_gradient_accumulation"]


def test_kernel_patches_are_registered_for_gpus_only_with_an_off_switch():
    assert sorted(p for p in REGISTRY if p.startswith("kernels.")) == sorted(KERNEL_PATCHES)
    for patch_id in KERNEL_PATCHES:
        patch = REGISTRY[patch_id]
        assert patch.kernel and patch.platforms == ("cuda", "rocm")
        assert "Off:" in patch.doc and patch_id in patch.doc
        assert skip_reason(patch, "cpu") is not None and skip_reason(patch, "rocm") is None


def test_no_patch_replaces_a_megatron_zaya_symbol():
    from megatron_zaya.patches.registry import resolve

    patches, _ = resolve("all")
    assert patches and not [p.id for p in patches if p.target.startswith("megatron_zaya")]


def _config(normalization):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, normalization=normalization)


def test_benchmark_gpt_entry_builds_triton_rmsnorm_in_local_specs(monkeypatch):
    from megatron.core.models import backends
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_zaya.ops.residual_norm import TritonRMSNorm

    for module, name in [(backends, "WrappedTorchNorm"), (backends, "LNImpl"), (gpt_layer_specs, "LNImpl")]:
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    from benchmarks.gpt_entry import use_triton_rmsnorm

    use_triton_rmsnorm()

    submodules = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm").submodules
    norm = submodules.input_layernorm(config=_config("RMSNorm"), hidden_size=64, eps=1e-5)
    assert isinstance(norm, TritonRMSNorm) and norm.eps == 1e-5
    final_norm = gpt_layer_specs.LNImpl(config=_config("RMSNorm"), hidden_size=64, eps=1e-6)
    assert isinstance(final_norm, TritonRMSNorm) and final_norm.eps == 1e-6
    assert isinstance(gpt_layer_specs.LNImpl(config=_config("LayerNorm"), hidden_size=64), torch.nn.LayerNorm)


def test_swiglu_patch_routes_megatron_calls_to_the_kernel(monkeypatch):
    from megatron.core.transformer import mlp
    from megatron.core.transformer.moe import experts, shared_experts

    from megatron_zaya.ops.experts import swiglu as swiglu_reference

    originals = []

    def megatron_default(*args):
        originals.append(args)
        return "megatron"

    for module, name in [(mlp, "bias_swiglu_impl"), (shared_experts, "bias_swiglu_impl"),
                         (mlp, "weighted_bias_swiglu_impl"), (experts, "weighted_bias_swiglu_impl")]:  # fmt: skip
        monkeypatch.setattr(module, name, megatron_default)
    REGISTRY["kernels.swiglu"].fn()

    x, probs = torch.randn(6, 2, 16), torch.rand(12, 1)
    torch.testing.assert_close(mlp.bias_swiglu_impl(x, None), swiglu_reference(x))
    torch.testing.assert_close(shared_experts.bias_swiglu_impl(x, None), swiglu_reference(x))
    flat = x.view(12, 16)
    torch.testing.assert_close(experts.weighted_bias_swiglu_impl(flat, None, probs), swiglu_reference(flat, probs))
    torch.testing.assert_close(mlp.weighted_bias_swiglu_impl(flat, None, probs), swiglu_reference(flat, probs))
    assert originals == []
    assert mlp.bias_swiglu_impl(x, None, True) == "megatron"  # fp8 activation store stays Megatron's
    assert experts.weighted_bias_swiglu_impl(flat, None, probs, True) == "megatron"


def test_cross_entropy_patch_takes_the_tp1_loss_and_leaves_the_rest_to_megatron(monkeypatch):
    from megatron.core import tensor_parallel
    from megatron.core.models.common.language_module import language_module

    from megatron_zaya.ops.lm_head import cross_entropy as cross_entropy_reference

    calls = []
    monkeypatch.setattr(tensor_parallel, "vocab_parallel_cross_entropy", lambda *a: calls.append(a) or "megatron")
    monkeypatch.setattr(language_module, "fused_vocab_parallel_cross_entropy", lambda *a: calls.append(a) or "fused")
    REGISTRY["kernels.cross_entropy"].fn()

    logits, labels = torch.randn(4, 2, 50), torch.randint(0, 50, (4, 2))
    expected = cross_entropy_reference(logits, labels)
    torch.testing.assert_close(tensor_parallel.vocab_parallel_cross_entropy(logits, labels), expected)
    torch.testing.assert_close(language_module.fused_vocab_parallel_cross_entropy(logits, labels, None), expected)
    assert calls == []
    assert tensor_parallel.vocab_parallel_cross_entropy(logits, labels, 0.1) == "megatron"  # label smoothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_gradient_patch_accumulates_megatron_linear_gradients_into_main_grad(monkeypatch, dtype):
    """Megatron's ``ColumnParallelLinear`` with gradient-accumulation fusion on the stand-in: two micro-batches
    leave the sum of their weight gradients in ``main_grad`` (float64 reference), and the layer tells DDP's hook
    so; fp32 ``main_grad`` for bf16 weights, ``main_grad`` in the weights' dtype for fp32 ones."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear, layers
    from megatron.core.transformer import TransformerConfig

    from megatron_zaya.runtime import ensure_single_process_parallel_state

    ensure_single_process_parallel_state()
    for name in ("_grad_accum_fusion_available", "fused_weight_gradient_mlp_cuda"):
        monkeypatch.setattr(layers, name, getattr(layers, name, None), raising=False)  # restored after the test
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))  # Megatron's dummy gradient
    REGISTRY["kernels.weight_gradient_accumulation"].fn()

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, gradient_accumulation_fusion=True,
                               params_dtype=dtype, use_cpu_initialization=True)
    linear = ColumnParallelLinear(32, 24, config=config, init_method=torch.nn.init.normal_, bias=False,
                                  gather_output=False, tp_group=parallel_state.get_tensor_model_parallel_group())
    weight = linear.weight
    weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32 if dtype == torch.bfloat16 else dtype)
    weight.grad_added_to_main_grad = False
    generator = torch.Generator().manual_seed(0)
    expected = torch.zeros(weight.shape, dtype=torch.float64)
    for _ in range(2):
        x = torch.randn(5, 3, 32, generator=generator).to(dtype).requires_grad_()
        grad = torch.randn(5, 3, 24, generator=generator).to(dtype)
        out, _ = linear(x)
        out.backward(grad)
        expected += grad.double().reshape(-1, 24).t() @ x.detach().double().reshape(-1, 32)
    assert weight.grad_added_to_main_grad
    torch.testing.assert_close(weight.main_grad.double(), expected, rtol=1e-5, atol=1e-5)
