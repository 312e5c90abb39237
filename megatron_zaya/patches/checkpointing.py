"""Patch group ``checkpointing``: background saves whose checksums are computed by the writer, and ZAYA1's local
checkpoint tier in Megatron's ``local_checkpoint_manager`` slot, without NVIDIA's resiliency package.

The tiers, their flags and their faults: ``megatron_zaya/training/checkpoint_tiers.py``, ``local_tier.py`` and
``docs/reliability.md``.
"""

from __future__ import annotations

import functools

from .registry import register, replace_attr


@register("checkpointing.background_checksums", target="megatron.training.checkpointing.schedule_async_save")
def background_checksums() -> None:
    """Checksum each rank's files of a ``--async-save`` in the background writer, not in the training loop.

    The tracker and ``zaya_checksums.json`` of a background save are written when Megatron finalizes it, from
    the training loop (``maybe_finalize_async_save``, training.py:3740), after every rank's writer is done; the
    ``reliability.atomic_tracker`` patch would then read the whole checkpoint on rank 0 while training waits.
    Wraps the name ``schedule_async_save`` that ``save_checkpoint`` calls (checkpointing.py:1121): a
    ``torch_dist`` request's write function (``FileSystemWriterAsync.write_preloaded_data_multithread``) is
    followed, in the writer process, by :func:`~megatron_zaya.training.checkpoint_tiers.write_then_record`'s
    record of the size and CRC-32 of the files that rank wrote; the finalization takes them (and hashes only
    files without a record, such as ``.metadata``). Other requests are unchanged.
    Off: leave ``checkpointing.background_checksums`` out of ``--zaya-patches`` (rank 0 then hashes every file).
    """
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.training import checkpointing

    from megatron_zaya.training.checkpoint_tiers import write_then_record

    original = checkpointing.schedule_async_save
    writer = FileSystemWriterAsync.write_preloaded_data_multithread

    @functools.wraps(original)
    def schedule_async_save(request):
        if getattr(request.async_fn, "func", None) is writer:
            request = request._replace(async_fn=functools.partial(write_then_record, request.async_fn))
        return original(request)

    replace_attr(checkpointing, "schedule_async_save", schedule_async_save)


@register("checkpointing.local_tier", target="megatron.training.training.setup_model_and_optimizer")
def local_tier() -> None:
    """``--non-persistent-ckpt-type local`` saves through ZAYA1's :class:`~megatron_zaya.training.local_tier.
    LocalTier`, without NVIDIA's resiliency package (which ROCm images lack).

    Megatron's local type takes its manager from the checkpointing context (``local_checkpoint_manager``:
    ``save``, ``find_latest``, ``load``; checkpointing.py:629, 940, 1491, 1529) and fills that slot with the
    resiliency package's, importing it in three places. Each is replaced for the local type only:
    ``validate_args`` (arguments.py:399) runs with the type hidden from its import check;
    ``pretrain`` (training.py:1193) gets a config without it, so that it builds an empty context;
    ``setup_model_and_optimizer``, which receives that context before the first load, puts a ``LocalTier`` into
    it; and ``MCoreTensorAwareStateDict.from_state_dict``, Megatron's own conversion of a rank's state that the
    package only gives a base class, runs without its ``HAVE_NVRX`` guard (tensor_aware_state_dict.py:127).
    Off: leave ``checkpointing.local_tier`` out of ``--zaya-patches`` (the local type then needs the package).
    """
    import megatron.training
    from megatron.core.dist_checkpointing import tensor_aware_state_dict
    from megatron.training import arguments, get_args, training

    from megatron_zaya.training.local_tier import LocalTier

    original_validate = arguments.validate_args

    @functools.wraps(original_validate)
    def validate_args(args, *rest, **kwargs):
        if args.non_persistent_ckpt_type != "local":
            return original_validate(args, *rest, **kwargs)
        args.non_persistent_ckpt_type = None
        try:
            return original_validate(args, *rest, **kwargs)
        finally:
            args.non_persistent_ckpt_type = "local"

    original_pretrain = training.pretrain

    @functools.wraps(original_pretrain)
    def pretrain(cfg_container, *rest, **kwargs):
        if cfg_container.checkpoint.non_persistent_ckpt_type == "local":
            cfg_container.checkpoint.non_persistent_ckpt_type = None  # the args keep it: checkpointing reads those
        return original_pretrain(cfg_container, *rest, **kwargs)

    original_setup = training.setup_model_and_optimizer

    @functools.wraps(original_setup)
    def setup_model_and_optimizer(*rest, checkpointing_context=None, **kwargs):
        args = get_args()
        if args.non_persistent_ckpt_type == "local" and checkpointing_context is not None:
            checkpointing_context.setdefault("local_checkpoint_manager", LocalTier(
                args.non_persistent_local_ckpt_dir, args.zaya_local_ckpt_keep, args.load))
        return original_setup(*rest, checkpointing_context=checkpointing_context, **kwargs)

    replace_attr(arguments, "validate_args", validate_args)
    for module in (megatron.training, training):
        replace_attr(module, "pretrain", pretrain)
    replace_attr(training, "setup_model_and_optimizer", setup_model_and_optimizer)
    replace_attr(tensor_aware_state_dict, "HAVE_NVRX", True)
