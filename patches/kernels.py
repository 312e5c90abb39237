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


def _tensor_parallel_size(tp_group) -> int:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if tp_group is not None:
        return dist.get_world_size(tp_group)
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_world_size()
    return 1


def _triton_loss(logits, target):
    from megatron_zaya.kernels.cross_entropy import cross_entropy

    return cross_entropy(logits, target)


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


# ---------------------------------------------------------------------------------- ZAYA1's own modules
@register("kernels.zaya_router", target="megatron_zaya.model.router.route_top1", platforms=GPU, kernel=True)
def use_triton_router() -> None:
    """Route ZAYA1 tokens with the fused Triton top-1 kernel (softmax, biased argmax, gate, counts in one pass).

    ``ZayaRouter.forward`` calls ``megatron_zaya.model.router.route_top1`` (plain torch: a softmax, an
    argmax, a gather, a one-hot and a reduction over [tokens, 17], each its own launch). The kernel
    (``megatron_zaya.kernels.router.route_top1``) returns the same four tensors; routers without the skip
    class keep the torch path. Also replaces ``router.router_projection`` (the router's first layer, D -> R,
    in fp32: an upcast copy of the activations and an fp32 SIMT GEMM, ~0.7 ms of a 9 ms ZAYA1-8B layer
    forward + backward) by ``kernels.router.router_projection``, a bf16 GEMM with fp32 output: the same
    forward products, bf16 gradients in the backward. Off: leave ``kernels.zaya_router`` out of
    ``--zaya-patches``.
    """
    from megatron_zaya.kernels.router import route_top1, router_projection
    from megatron_zaya.model import router

    reference = router.route_top1

    def fused_route_top1(logits, biases, num_experts):
        if logits.shape[-1] != num_experts + 1:
            return reference(logits, biases, num_experts)
        return route_top1(logits, biases, num_experts)

    replace_attr(router, "route_top1", fused_route_top1)
    replace_attr(router, "router_projection", router_projection)


@register("kernels.zaya_residual", target="megatron_zaya.model.layer.merge_and_norm", platforms=GPU, kernel=True)
def use_fused_residual() -> None:
    """Run ZAYA1's residual path (merges into the fp32 stream and the RMSNorms after them) on Triton kernels.

    Unfused, each layer casts the fp32 stream to bf16 before each of its two norms, normalises in eager torch
    (~6 passes), and merges each sublayer output with ``ResidualScaling`` (~6 fp32 passes forward, ~10 and
    4 reductions backward): on an H200 about 100 ms of a 760 ms ZAYA1-8B-width step (8 layers, 32k tokens).
    Replaced, in ``megatron_zaya.model.layer``: ``merge_and_norm`` (attention merge + pre-MoE norm) by
    ``residual_rms_norm``, ``norm_residual`` (input and final norms, with the cast) by ``residual_norm``;
    and ``ResidualScaling.forward`` (the MoE merge) by ``residual_merge``: one read and one write per tensor
    each way. Configs without the fp32 residual stream or without residual scaling keep the torch path.
    Off: leave ``kernels.zaya_residual`` out of ``--zaya-patches``.
    """
    import torch

    from megatron_zaya.kernels.residual_rmsnorm import residual_merge, residual_norm, residual_rms_norm
    from megatron_zaya.model import layer, norm

    reference_norm, reference_merge_and_norm = layer.norm_residual, layer.merge_and_norm
    reference_merge = norm.ResidualScaling.forward

    def fusable(rms_norm, residual, dtype):
        return isinstance(rms_norm, norm.RMSNorm) and residual.dtype == torch.float32 and rms_norm.weight.dtype == dtype

    def fused_norm_residual(rms_norm, residual, dtype):
        if not fusable(rms_norm, residual, dtype):
            return reference_norm(rms_norm, residual, dtype)
        return residual_norm(residual, rms_norm.weight, rms_norm.eps)

    def fused_merge_and_norm(merge, rms_norm, hidden, residual, dtype):
        if not (isinstance(merge, norm.ResidualScaling) and fusable(rms_norm, residual, dtype)):
            return reference_merge_and_norm(merge, rms_norm, hidden, residual, dtype)
        return residual_rms_norm(hidden, residual, merge.hidden_states_bias, merge.hidden_states_scale,
                                 merge.residual_bias, merge.residual_scale, rms_norm.weight, rms_norm.eps)

    def fused_merge(self, hidden_states, residual):
        if self.residual_dtype != torch.float32:
            return reference_merge(self, hidden_states, residual)
        return residual_merge(hidden_states, residual, self.hidden_states_bias, self.hidden_states_scale,
                              self.residual_bias, self.residual_scale)

    replace_attr(layer, "norm_residual", fused_norm_residual)
    replace_attr(layer, "merge_and_norm", fused_merge_and_norm)
    replace_attr(norm.ResidualScaling, "forward", fused_merge)


@register("kernels.zaya_cca", target="megatron_zaya.model.cca.cca_qk", platforms=GPU, kernel=True)
def use_triton_cca() -> None:
    """CCA's q/k path as Triton kernels: both causal convolutions in one pass, then the epilogue (mean skip
    terms, L2 norm, key temperature, partial RoPE) in another.

    ``CompressedConvAttention.forward`` calls ``megatron_zaya.model.cca.cca_qk``, whose torch version pads,
    runs two cuDNN ``conv1d`` calls in [B, C, S] with layout conversions around each, and makes a dozen
    elementwise passes over q and k in fp32. The replacement runs ``megatron_zaya.kernels.cca.cca_qk``, reading
    the RoPE angles of this rank's positions from Megatron's rotary table. Off: leave ``kernels.zaya_cca`` out
    of ``--zaya-patches``.
    """
    from megatron_zaya.kernels.cca import cca_qk
    from megatron_zaya.model import cca

    def fused_cca_qk(q0, k0, conv, key_temperature, rotary_pos_emb, *, time0, time1, head_dim, config, cp_group,
                     qk_history=None, document_offsets=None):
        # [s, 1 or b, rot]: Megatron's table (already this CP rank's), per sequence with packed documents
        angles = rotary_pos_emb[:, :, 0, :].float()
        q, k = cca_qk(q0, k0, conv.q_depthwise_weight.squeeze(1), conv.q_depthwise_bias,
                      conv.k_depthwise_weight.squeeze(1), conv.k_depthwise_bias, conv.q_grouped_weight,
                      conv.q_grouped_bias, conv.k_grouped_weight, conv.k_grouped_bias, key_temperature,
                      angles.cos(), angles.sin(), qk_history, document_offsets)  # depthwise weights as [C, taps]
        return q, k

    replace_attr(cca, "cca_qk", fused_cca_qk)


@register("kernels.zaya_lm_head", target="megatron_zaya.model.model.ZayaModel.lm_head_loss", platforms=GPU,
          kernel=True)
def use_fused_lm_head() -> None:
    """Fuse ZAYA1's LM head with the cross-entropy, chunked so that [tokens, 262k] logits never exist.

    ``ZayaModel.lm_head_loss`` computes fp32 logits (an fp32 matmul, ZAYA1's high-precision head) and then
    Megatron's cross-entropy: at ZAYA1-8B's vocabulary that is 4.3 GB of logits per 4096 tokens and an fp32
    GEMM. ``megatron_zaya.kernels.cross_entropy.linear_cross_entropy`` multiplies the bf16 hidden states and
    weights with fp32 accumulation and output (the same products as an fp32 matmul of bf16 values) chunk by
    chunk, keeping only a per-token logsumexp, and by default computes the gradients during the forward
    (``--zaya-lm-head-backward recompute`` trades that for a recomputation in the backward and less memory).
    With a vocabulary split across TP ranks the torch path stays.
    Off: leave ``kernels.zaya_lm_head`` out of ``--zaya-patches``.
    """
    from megatron_zaya.kernels.cross_entropy import linear_cross_entropy
    from megatron_zaya.model.model import ZayaModel

    reference = ZayaModel.lm_head_loss

    def fused_lm_head_loss(self, hidden, weight, labels):
        if self.pg_collection.tp.size() > 1:
            return reference(self, hidden, weight, labels)
        weight = weight if weight is not None else self.output_layer.weight
        seq, batch, width = hidden.shape
        loss = linear_cross_entropy(hidden.reshape(seq * batch, width), weight.to(hidden.dtype),
                                    labels.transpose(0, 1).reshape(-1),
                                    grad_in_forward=self.config.lm_head_grad_in_forward)
        return loss.view(seq, batch).transpose(0, 1).contiguous()

    replace_attr(ZayaModel, "lm_head_loss", fused_lm_head_loss)


@register("kernels.zaya_experts", target="megatron_zaya.model.experts.ZayaExperts.forward", platforms=GPU,
          kernel=True)
def use_grouped_experts() -> None:
    """Run ZAYA1's top-1 SwiGLU experts as two Triton grouped GEMMs instead of a Python loop over experts.

    ``ZayaExperts`` is Megatron's ``SequentialMLP``: one fc1 GEMM, activation and fc2 GEMM per local expert,
    32 small launches per MoE layer and a host sync on the token counts. The replacement runs
    ``megatron_zaya.kernels.grouped_gemm.grouped_gemm`` twice around the probability-weighted SwiGLU kernel, on
    the experts' own weights found by address (same parameters and checkpoint layout, no stacked copy).
    Expert tensor parallelism, fp8/fp4 and probabilities applied on the input keep Megatron's loop.
    Off: leave ``kernels.zaya_experts`` out of ``--zaya-patches``.
    """
    import torch

    from megatron_zaya.kernels.grouped_gemm import grouped_gemm
    from megatron_zaya.kernels.swiglu import swiglu
    from megatron_zaya.model.experts import ZayaExperts

    reference = ZayaExperts.forward

    def grouped_forward(self, hidden, tokens_per_expert, probs):
        cfg = self.config
        if cfg.fp8 or cfg.fp4 or cfg.moe_apply_probs_on_input or self.tp_group.size() > 1 or cfg.add_bias_linear:
            return reference(self, hidden, tokens_per_expert, probs)
        counts = tokens_per_expert.to(device=hidden.device, dtype=torch.int64)
        # each expert's [2F, D] and [D, F] weights, read in place (no stacked copy)
        fc1 = [expert.linear_fc1.weight for expert in self.local_experts]
        fc2 = [expert.linear_fc2.weight for expert in self.local_experts]
        # padded_rows: ZayaMoELayer's single-rank dispatch hands over all tokens, the skip class's last
        intermediate = swiglu(grouped_gemm(hidden, fc1, counts, padded_rows=True), weights=probs.unsqueeze(-1))
        return grouped_gemm(intermediate.to(hidden.dtype), fc2, counts, padded_rows=True), None

    replace_attr(ZayaExperts, "forward", grouped_forward)
