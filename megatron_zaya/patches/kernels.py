"""Patch group ``kernels``: Triton kernels (megatron_zaya/kernels, through megatron_zaya/ops) swapped in for
Megatron-Core defaults.

One patch per kernel, each for CUDA and ROCm only (on CPU the defaults stay). Each replacement keeps the
signature of what it replaces and hands anything it does not cover (fp8 activation store, label smoothing,
tensor-parallel vocab, ...) back to the original. These serve Megatron's own modules; the ZAYA1 model chooses
its kernels itself when it is built (``ZayaConfig.kernels``, ``--zaya-kernels``).

Turn one off by leaving it out of ``--zaya-patches`` / ``ZAYA_PATCHES`` (an allow-list of ids or groups,
e.g. ``--zaya-patches startup,cpu,optim,kernels.swiglu``), or all of them by leaving out ``kernels``.
Nothing heavy is imported here until a patch is applied.
"""

from __future__ import annotations

import functools

from .registry import register, replace_attr

GPU = ("cuda", "rocm")


def _triton_bias_swiglu(original):
    @functools.wraps(original)
    def bias_swiglu_impl(input, bias, fp8_input_store=False, cpu_offload_input=False):
        if fp8_input_store or cpu_offload_input:
            return original(input, bias, fp8_input_store, cpu_offload_input)
        from megatron_zaya.ops.experts import fused_swiglu

        return fused_swiglu(input, bias=bias)

    return bias_swiglu_impl


def _triton_weighted_bias_swiglu(original):
    @functools.wraps(original)
    def weighted_bias_swiglu_impl(input, bias, weights, fp8_input_store=False):
        if fp8_input_store:
            return original(input, bias, weights, fp8_input_store)
        from megatron_zaya.ops.experts import fused_swiglu

        return fused_swiglu(input, weights, bias)

    return weighted_bias_swiglu_impl


@register(
    "kernels.swiglu", target="megatron.core.fusions.fused_bias_swiglu.bias_swiglu_impl", platforms=GPU, kernel=True
)
def use_triton_swiglu() -> None:
    """Run Megatron's fused (weighted) bias-SwiGLU on the Triton kernel of ``kernels/swiglu.py``.

    With ``--bias-swiglu-fusion`` (``bias_activation_fusion``) Megatron's MLP, experts and shared experts
    call ``bias_swiglu_impl`` / ``weighted_bias_swiglu_impl``, which are ``torch.compile``'d elementwise
    chains (or eager ones where compile is off) computing in bf16. The Triton kernel reads the packed
    [gate ‖ up] tensor once, computes in fp32 and writes once, forward and backward, on CUDA and ROCm alike.
    Patched where they are imported by name: ``megatron.core.transformer.mlp``, ``...moe.experts`` and
    ``...moe.shared_experts``. fp8 activation storage and CPU offload of the input fall back to Megatron's
    implementation. Off: leave ``kernels.swiglu`` out of ``--zaya-patches`` / ``ZAYA_PATCHES``.
    """
    from megatron.core.transformer import mlp
    from megatron.core.transformer.moe import experts, shared_experts

    for module in (mlp, shared_experts):
        replace_attr(module, "bias_swiglu_impl", _triton_bias_swiglu(module.bias_swiglu_impl))
    for module in (mlp, experts):
        weighted = _triton_weighted_bias_swiglu(module.weighted_bias_swiglu_impl)
        replace_attr(module, "weighted_bias_swiglu_impl", weighted)


def _tensor_parallel_size(tp_group) -> int:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if tp_group is not None:
        return dist.get_world_size(tp_group)
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_world_size()
    return 1


def _triton_loss(logits, target):
    from megatron_zaya.ops.lm_head import fused_cross_entropy

    return fused_cross_entropy(logits, target)


def _triton_vocab_parallel_cross_entropy(original):
    @functools.wraps(original)
    def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None):
        if label_smoothing or _tensor_parallel_size(tp_group) > 1:
            return original(vocab_parallel_logits, target, label_smoothing, tp_group)
        return _triton_loss(vocab_parallel_logits, target)

    return vocab_parallel_cross_entropy


def _triton_fused_vocab_parallel_cross_entropy(original):
    @functools.wraps(original)
    def fused_vocab_parallel_cross_entropy(vocab_parallel_logits, target, tp_group):
        if _tensor_parallel_size(tp_group) > 1:
            return original(vocab_parallel_logits, target, tp_group)
        return _triton_loss(vocab_parallel_logits, target)

    return fused_vocab_parallel_cross_entropy


@register(
    "kernels.cross_entropy",
    target="megatron.core.tensor_parallel.vocab_parallel_cross_entropy",
    platforms=GPU,
    kernel=True,
)
def use_triton_cross_entropy() -> None:
    """Compute the language-model loss with the Triton cross-entropy when the vocabulary is not split (TP=1).

    ``LanguageModule.compute_language_model_loss`` calls ``tensor_parallel.vocab_parallel_cross_entropy``
    (or ``fused_vocab_parallel_cross_entropy`` with ``--cross-entropy-loss-fusion``), which upcasts the
    [s, b, V] logits to fp32 and makes several full passes (max, exp, sum, softmax kept for the backward):
    at ZAYA1's V = 262,272 that is GBs of traffic and memory per micro-batch. The Triton kernel makes one
    read of the logits forward and one read + one write backward, keeping only a [s*b] logsumexp.
    Replaced: ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy`` (looked up there at call time)
    and ``language_module.fused_vocab_parallel_cross_entropy``. Tensor-parallel vocabularies and label
    smoothing go to Megatron's implementation. (The LM head fused with the loss, ``linear_cross_entropy``,
    needs the model to skip materialising logits; ZAYA's model calls it directly.) Off: leave
    ``kernels.cross_entropy`` out of ``--zaya-patches`` / ``ZAYA_PATCHES``.
    """
    from megatron.core import tensor_parallel
    from megatron.core.models.common.language_module import language_module

    plain = _triton_vocab_parallel_cross_entropy(tensor_parallel.vocab_parallel_cross_entropy)
    replace_attr(tensor_parallel, "vocab_parallel_cross_entropy", plain)
    fused = _triton_fused_vocab_parallel_cross_entropy(language_module.fused_vocab_parallel_cross_entropy)
    replace_attr(language_module, "fused_vocab_parallel_cross_entropy", fused)


class _WeightGradientAccumulation:
    """What Megatron calls as apex's ``fused_weight_gradient_mlp_cuda``: ``main_grad += grad_outputᵀ · input`` for
    2-D ``input [T, in]`` and ``grad_output [T, out]``, accumulated in ``main_grad``'s dtype."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        from megatron_zaya.kernels.utils import matmul_fp32_into

        matmul_fp32_into(main_grad, grad_output.t(), total_input, accumulate=True)

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input, grad_output, main_grad):
        main_grad.addmm_(grad_output.t(), total_input)


def _apex_weight_gradient_present() -> str | None:
    import importlib.util

    if importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None:
        return "apex provides fused_weight_gradient_mlp_cuda, which Megatron uses"
    return None


@register(
    "kernels.weight_gradient_accumulation",
    target="megatron.core.tensor_parallel.layers.fused_weight_gradient_mlp_cuda",
    platforms=GPU,
    kernel=True,
    requires=_apex_weight_gradient_present,
)
def use_torch_weight_gradient_accumulation() -> None:
    """Let Megatron's linear layers add their weight gradients straight into ``main_grad`` without apex.

    With ``gradient_accumulation_fusion`` (Megatron's default; ``--no-gradient-accumulation-fusion`` turns it
    off) a ``ColumnParallelLinear``/``RowParallelLinear`` under Megatron's DDP computes its weight gradient as one
    GEMM accumulating into the fp32 ``main_grad``, through apex's ``fused_weight_gradient_mlp_cuda``; Megatron
    refuses the setting where apex is missing (ROCm images and pip installs). Unfused, each such layer writes a
    bf16 weight gradient that DDP's hook then adds to ``main_grad``: one more kernel, one more allocation and a
    bf16 rounding per layer and micro-batch (CCA's four projections in every ZAYA1 layer). The stand-in makes
    the same accumulation with torch's GEMM with fp32 output (``kernels.utils.matmul_fp32_into``).
    Replaced: ``megatron.core.tensor_parallel.layers.fused_weight_gradient_mlp_cuda`` (absent without apex) and
    its ``_grad_accum_fusion_available`` flag; skipped where apex provides the module. Off: leave
    ``kernels.weight_gradient_accumulation`` out of ``--zaya-patches`` / ``ZAYA_PATCHES``; the layers then
    return bf16 weight gradients.
    """
    from megatron.core.tensor_parallel import layers

    replace_attr(layers, "_grad_accum_fusion_available", True)
    layers.fused_weight_gradient_mlp_cuda = _WeightGradientAccumulation
