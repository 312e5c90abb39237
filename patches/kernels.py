"""Patch group ``kernels``: Triton kernels (megatron_zaya/kernels) swapped in for Megatron-Core defaults.

One patch per kernel, each for CUDA and ROCm only (on CPU the defaults stay). Each replacement keeps the
signature of what it replaces and hands anything it does not cover (fp8 activation store, label smoothing,
tensor-parallel vocab, ...) back to the original. ZAYA's own modules (residual scaling, router, CCA, grouped
experts) call the kernels directly; see each kernel module's public function.

Turn one off by leaving it out of ``--zaya-patches`` / ``ZAYA_PATCHES`` (an allow-list of ids or groups,
e.g. ``--zaya-patches startup,cpu,optim,kernels.rmsnorm``), or all of them by leaving out ``kernels``.
Nothing heavy is imported here until a patch is applied.
"""

from __future__ import annotations

import functools

from .registry import register, replace_attr

GPU = ("cuda", "rocm")


class TritonOrTorchNorm:
    """Megatron's ``WrappedTorchNorm`` with RMSNorm built as ``TritonRMSNorm`` (LayerNorm/L2Norm unchanged)."""

    torch_norm = None  # the WrappedTorchNorm replaced, set by the patch

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        if config.normalization == "RMSNorm":
            from megatron_zaya.kernels.residual_rmsnorm import TritonRMSNorm

            return TritonRMSNorm(config, hidden_size, eps)
        return cls.torch_norm(config, hidden_size, eps, **kwargs)


@register(
    "kernels.rmsnorm", target="megatron.core.transformer.torch_norm.WrappedTorchNorm", platforms=GPU, kernel=True
)
def use_triton_rmsnorm() -> None:
    """Build RMSNorm in Megatron's local (no Transformer Engine) specs with the Triton ``TritonRMSNorm``.

    Without TE or apex, ``LocalSpecProvider`` and the GPT block spec build every norm through
    ``WrappedTorchNorm``, i.e. ``torch.nn.RMSNorm``: unfused eager math (~300 GB/s effective on an H200)
    that also refuses sequence parallelism. ``TritonRMSNorm`` is one read and one write per element,
    supports SP, computes ZayaRMSNorm's math, and keeps the checkpoint layout (a single ``weight``).
    Replaced where the specs look it up at call time: ``megatron.core.models.backends.WrappedTorchNorm``
    and the ``LNImpl`` globals of ``backends`` and ``gpt_layer_specs`` (when they are WrappedTorchNorm,
    i.e. apex is absent). TE specs (``TENorm``) are untouched. Off: leave ``kernels.rmsnorm`` out of
    ``--zaya-patches`` / ``ZAYA_PATCHES``.
    """
    from megatron.core.models import backends
    from megatron.core.models.gpt import gpt_layer_specs

    torch_norm = backends.WrappedTorchNorm
    TritonOrTorchNorm.torch_norm = torch_norm
    replace_attr(backends, "WrappedTorchNorm", TritonOrTorchNorm)
    for module in (backends, gpt_layer_specs):
        if module.LNImpl is torch_norm:
            replace_attr(module, "LNImpl", TritonOrTorchNorm)


def _triton_bias_swiglu(original):
    @functools.wraps(original)
    def bias_swiglu_impl(input, bias, fp8_input_store=False, cpu_offload_input=False):
        if fp8_input_store or cpu_offload_input:
            return original(input, bias, fp8_input_store, cpu_offload_input)
        from megatron_zaya.kernels.swiglu import swiglu

        return swiglu(input, bias=bias)

    return bias_swiglu_impl


def _triton_weighted_bias_swiglu(original):
    @functools.wraps(original)
    def weighted_bias_swiglu_impl(input, bias, weights, fp8_input_store=False):
        if fp8_input_store:
            return original(input, bias, weights, fp8_input_store)
        from megatron_zaya.kernels.swiglu import swiglu

        return swiglu(input, weights, bias)

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
