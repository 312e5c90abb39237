"""Patch group ``optim``: megatron-zaya's optimizers inside Megatron's training loop (see registry.py)."""

from __future__ import annotations

import functools

import torch

from .registry import fused_adam_present, register, replace_attr


@register("optim.zaya_muon", target="megatron.training.training.get_megatron_optimizer")
def zaya_muon_optimizer() -> None:
    """``--optimizer zaya_muon``: build ZayaMuon (Muon on matrices) + AdamW in ``setup_model_and_optimizer``.

    Replaces the name ``get_megatron_optimizer`` that ``megatron.training.training`` imported (the one
    ``setup_model_and_optimizer`` calls) with a wrapper: for ``config.optimizer == "zaya_muon"`` it calls
    ``megatron_zaya.optim.megatron.get_zaya_muon_optimizer``, for anything else the original. On either, it adds
    the hooks of ``--zaya-router-freeze-tokens`` and ``--zaya-expert-clip-grad`` when they are given
    (``megatron_zaya.training.recipe``); the factory is the one place that sees the optimizer and the model.

    Why a patch: Megatron 0.19.2 sends unknown optimizer names to its emerging-optimizer registry, which
    requires the ``emerging-optimizers`` package, treats ZAYA1's 3-D expert weights as non-matrices and
    cannot shard Newton–Schulz per matrix over data-parallel ranks; the factory is not otherwise pluggable.

    Off: ``--zaya-patches``/``ZAYA_PATCHES`` without ``optim`` (then only Megatron's own optimizers work, and the
    two recipe flags are refused).
    """
    import megatron.training.training as training

    from megatron_zaya.optim.megatron import wrap_get_megatron_optimizer
    from megatron_zaya.training.recipe import install_recipe

    replace_attr(training, "get_megatron_optimizer",
                 wrap_get_megatron_optimizer(training.get_megatron_optimizer, install_recipe))


@register("optim.optimizer_choice", target="megatron.training.arguments._add_training_args")
def zaya_muon_choice() -> None:
    """Make ``zaya_muon`` a valid ``--optimizer`` choice of every parser Megatron builds.

    Megatron fixes the ``--optimizer`` choices in ``_add_training_args``, and ``pretrain()`` re-parses the
    command line with its own parser (``ft_integration.setup``: unknown flags are ignored there, an
    unknown choice is an error), so allowing the choice in the ``extra_args_provider`` alone fails at
    start-up. The wrapper adds ``zaya_muon`` to the choices after the original has built them.

    Off: ``--zaya-patches``/``ZAYA_PATCHES`` without ``optim``.
    """
    import megatron.training.arguments as arguments

    from megatron_zaya.optim.args import allow_zaya_muon

    original = arguments._add_training_args

    @functools.wraps(original)
    def _add_training_args(parser):
        return allow_zaya_muon(original(parser))

    replace_attr(arguments, "_add_training_args", _add_training_args)


@register("optim.zaya_muon_zero1", target="megatron.training.training.tag_params_for_buffer_routing")
def zaya_muon_zero1() -> None:
    """``--use-distributed-optimizer --optimizer zaya_muon``: ZeRO-1 on DDP buffers laid out by matrix owner.

    For any optimizer but Adam/SGD, Megatron's ``validate_args`` turns ``--use-distributed-optimizer`` into its
    layer-wise distributed optimizer, and ``get_model`` (``wrap_model_chunks_with_ddp``) then tags the matrices
    with ``tag_params_for_buffer_routing`` and lays out DDP's buffers with
    ``LayerWiseDistributedOptimizer.compute_full_param_layout``. Both names, as ``megatron.training.training``
    imported them, are replaced for ``--optimizer zaya_muon`` by ``optim.zero``'s: ZayaMuon's matrices (its
    ``roles``, not every 2-D tensor) go whole into the shard of the rank that owns them by Newton–Schulz FLOPs.
    Other optimizers get the originals. ``get_zaya_muon_optimizer`` then builds ZayaMuon over each rank's
    matrices and Megatron's ``DistributedOptimizer`` for AdamW. Without this patch, ``--optimizer zaya_muon
    --use-distributed-optimizer`` stops with a one-line error at optimizer set-up.

    Off: ``--zaya-patches``/``ZAYA_PATCHES`` without ``optim``.
    """
    import megatron.training.training as training

    from megatron_zaya.optim import zero

    original_tag, original_layout_class = training.tag_params_for_buffer_routing, training.LayerWiseDistributedOptimizer

    @functools.wraps(original_tag)
    def tag_params_for_buffer_routing(model_chunks):
        from megatron.training.global_vars import get_args

        from megatron_zaya.optim.args import uses_zero1

        args = get_args()
        if not uses_zero1(args):
            return original_tag(model_chunks)
        return zero.tag_muon_params(model_chunks, split_gate_up=args.zaya_muon_split_gate_up)

    class LayerWiseDistributedOptimizer(original_layout_class):
        @staticmethod
        def compute_full_param_layout(params, *args, **kwargs):
            if zero.is_tagged(params):
                return zero.compute_full_param_layout(params, *args, **kwargs)
            return original_layout_class.compute_full_param_layout(params, *args, **kwargs)

    replace_attr(training, "tag_params_for_buffer_routing", tag_params_for_buffer_routing)
    replace_attr(training, "LayerWiseDistributedOptimizer", LayerWiseDistributedOptimizer)


@register("optim.fused_torch_adam", target="megatron.core.optimizer._get_megatron_optimizer_based_on_param_groups",
          platforms=("cuda", "rocm"), requires=fused_adam_present)
def fused_torch_adam() -> None:
    """Run Megatron's torch Adam fallback as torch's fused kernel (``fused=True``) on GPUs.

    Without Transformer Engine or apex, Megatron builds ``torch.optim.AdamW`` with its default, the foreach
    implementation: about ten multi-tensor passes over the fp32 state per step. ``fused=True`` does one pass
    (one read of parameter, gradient and both moments, one write), the same update up to fp32 rounding. The
    wrapper (``optim.megatron.wrap_get_optimizer_based_on_param_groups``) switches the optimizer Megatron's
    factory returns before its first step; it covers ``--optimizer adam`` and the AdamW half of
    ``--optimizer zaya_muon``, with or without the distributed optimizer. A checkpoint keeps the flag it was
    saved with (torch restores param groups whole), so a run resumed from an unfused checkpoint stays unfused.
    Skipped when TE/apex provide FusedAdam (Megatron uses theirs) and on CPU.

    Off: leave ``optim.fused_torch_adam`` out of ``--zaya-patches``/``ZAYA_PATCHES`` (``zaya-patches list``
    prints the ids).
    """
    import megatron.core.optimizer as megatron_optimizer

    from megatron_zaya.optim.megatron import wrap_get_optimizer_based_on_param_groups

    original = megatron_optimizer._get_megatron_optimizer_based_on_param_groups
    replace_attr(megatron_optimizer, "_get_megatron_optimizer_based_on_param_groups",
                 wrap_get_optimizer_based_on_param_groups(original))


def _megatron_fallback_norm(module: str, name: str) -> str | None:
    """The reason to skip where ``module.name``, Megatron's multi-tensor L2 norm there, is Transformer Engine's or
    apex's rather than its own fallback ``local_multi_tensor_l2_norm``, else None."""
    import importlib

    from megatron.core import utils

    if getattr(importlib.import_module(module), name) is not utils.local_multi_tensor_l2_norm:
        return "Transformer Engine or apex provides multi_tensor_l2norm, which Megatron uses instead"
    return None


def _l2_norm_on_device(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``local_multi_tensor_l2_norm``'s result, ``[‖all tensors‖₂]`` fp32 on their device, with no host round
    trip: torch's multi-tensor norm per tensor in fp32, then the norm of those."""
    norms = [norm for tensors in tensor_lists for norm in torch._foreach_norm(tensors, 2, dtype=torch.float32)]
    return torch.linalg.vector_norm(torch.stack(norms)).view(1), None


def _scale_on_device(chunk_size, noop_flag, tensor_lists, scale):
    """``local_multi_tensor_scale``: ``dst = src * scale`` as torch multi-tensor ops: one multiplication in place
    where ``dst`` is ``src`` (the clipping's call), else a copy of the scaled sources. No tensors: nothing to do."""
    sources, destinations = tensor_lists
    if not destinations:
        return
    if all(source is destination for source, destination in zip(sources, destinations)):
        torch._foreach_mul_(destinations, scale)
    else:
        torch._foreach_copy_(destinations, torch._foreach_mul(sources, scale))


@register("optim.grad_norm_on_device", target="megatron.core.optimizer.clip_grads.l2_norm_impl",
          requires=functools.partial(_megatron_fallback_norm, "megatron.core.optimizer.clip_grads", "l2_norm_impl"))
def grad_norm_on_device() -> None:
    """Megatron's gradient norm and clipping without a host round trip per parameter, where it falls back to its own
    multi-tensor functions (no Transformer Engine or apex: the GPU images here, most ROCm installs).

    The fallback ``local_multi_tensor_l2_norm`` takes one ``torch.norm`` per gradient, gathers the norms into a host
    tensor (``torch.tensor`` of a list of device scalars: one synchronisation each), and copies their norm back: at
    ZAYA1-8B's 40 layers 2,564 launches and as many waits for the device every step. ``local_multi_tensor_scale``
    clips with a multiplication and a copy per gradient. The replacements compute the same norm with
    ``torch._foreach_norm`` in fp32 and the norm of the norms on the device (equal up to fp32 rounding: the
    per-gradient norms are summed on the device instead of the host), and scale in place with
    ``torch._foreach_mul_``; the one wait left is Megatron's ``.item()`` of the total. Patched where
    ``clip_grads`` bound the fallbacks at import.

    Off: leave ``optim.grad_norm_on_device`` out of ``--zaya-patches``/``ZAYA_PATCHES``.
    """
    from megatron.core.optimizer import clip_grads

    replace_attr(clip_grads, "l2_norm_impl", _l2_norm_on_device)
    replace_attr(clip_grads, "multi_tensor_scale_impl", _scale_on_device)


def _copy_on_device(this, that, overflow_buf=None):
    """Megatron's ``_multi_tensor_copy_this_to_that``: each tensor of ``this`` into its place in ``that``, cast to its
    dtype, as one torch multi-tensor copy (``overflow_buf``, a dummy for apex's kernel there, is not needed)."""
    if that:
        torch._foreach_copy_(that, this)


@register("optim.weight_copies_on_device",
          target="megatron.core.optimizer.optimizer._multi_tensor_copy_this_to_that")
def weight_copies_on_device() -> None:
    """Megatron's copies between the fp32 master weights and the 16-bit model weights as one multi-tensor copy.

    ``Float16OptimizerWithFloat16Params`` copies every master weight into its model weight after each step (and back
    when loading) with ``_multi_tensor_copy_this_to_that``. For bf16 Megatron has no multi-tensor path: it loops
    over the weights with one ``copy_`` each; for fp16 without Transformer Engine or apex its fallback multiplies
    each weight by 1 into an fp32 temporary and copies that. Under ``--optimizer zaya_muon`` these are every
    parameter ZayaMuon steps, 2,564 at ZAYA1-8B's 40 layers. The replacement copies with ``torch._foreach_copy_``,
    which casts as it copies: the same bits, from one call.

    Off: leave ``optim.weight_copies_on_device`` out of ``--zaya-patches``/``ZAYA_PATCHES``.
    """
    from megatron.core.optimizer import optimizer

    replace_attr(optimizer, "_multi_tensor_copy_this_to_that", _copy_on_device)


@register("optim.params_norm_on_device", target="megatron.training.utils.common_utils.multi_tensor_l2norm",
          requires=functools.partial(_megatron_fallback_norm, "megatron.training.utils.common_utils",
                                     "multi_tensor_l2norm"))
def params_norm_on_device() -> None:
    """``--log-params-norm`` without a host round trip per parameter, where Megatron falls back to its own
    multi-tensor norm (no Transformer Engine or apex).

    ``calc_params_l2_norm`` takes the norm of every (master) weight after each step through the fallback
    ``local_multi_tensor_l2_norm``, which waits for the device once per weight (see ``optim.grad_norm_on_device``):
    2,564 waits per step at ZAYA1-8B's 40 layers. The replacement is that patch's: torch's multi-tensor norm in
    fp32, then the norm of the norms, on the device. Patched where ``common_utils`` bound the fallback at import.

    Off: leave ``optim.params_norm_on_device`` out of ``--zaya-patches``/``ZAYA_PATCHES``.
    """
    from megatron.training.utils import common_utils

    replace_attr(common_utils, "multi_tensor_l2norm", _l2_norm_on_device)
