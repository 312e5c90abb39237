"""Patch group ``checkpointing``: background saves staged through pinned host memory and written by a thread,
files checksummed as they are written, and ZAYA1's local checkpoint tier in Megatron's ``local_checkpoint_manager``
slot, without NVIDIA's resiliency package.

The tiers, their flags and their faults: ``megatron_zaya/checkpoint/tiers.py``, ``local_tier.py`` and
``docs/reliability.md``.
"""

from __future__ import annotations

import functools

from ..errors import PatchError
from .registry import megatron_version, register, replace_attr


@register("checkpointing.background_saves", target="megatron.training.checkpointing.schedule_async_save")
def background_saves() -> None:
    """A ``--async-save`` is copied into a pinned host pool beside the next step, on a CUDA stream of its own,
    and written from it by a thread of the training process; the device holds no copy of the state.

    Megatron's request has the writer process copy the training tensors to host memory while the training loop
    waits for it (``PersistentAsyncCaller.schedule_async_call`` joins its preload, async_utils.py:421): 21 s
    per save of the 8-layer model on one H200; copying them on the device first needs free device memory the
    size of the state. Wraps the name ``schedule_async_save`` that ``save_checkpoint`` calls
    (checkpointing.py:1121) with :func:`~megatron_zaya.checkpoint.staging.background_request` for a ``torch_dist``
    request (one whose preload is ``FileSystemWriterAsync.preload_tensors``): the copies and Megatron's write in
    a thread (why not in the writer process: that function's docstring), the writer process waiting for it.
    Other requests are unchanged. And ``setup_model_and_optimizer``, with ``--async-save``, makes the model
    config's ``finalize_model_grads_func`` first wait for the copies (:func:`_fence_copies`), and starts allocating
    the pool in a thread (:func:`_allocate_pool`): the first save's call paid 19.6 s for it on one H200.
    Off: leave ``checkpointing.background_saves`` out of ``--zaya-patches`` (the loop then waits for the copy
    to host memory).
    """
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.training import checkpointing, get_args, training

    from megatron_zaya.checkpoint.staging import background_request

    original = checkpointing.schedule_async_save

    @functools.wraps(original)
    def schedule_async_save(request):
        if getattr(request.preload_fn, "func", None) is FileSystemWriterAsync.preload_tensors:
            request = background_request(request)
        return original(request)

    original_setup = training.setup_model_and_optimizer

    @functools.wraps(original_setup)
    def setup_model_and_optimizer(*args, **kwargs):
        model, *others = original_setup(*args, **kwargs)
        if get_args().async_save:
            _fence_copies(model)
            _allocate_pool(whole=True)
        return (model, *others)

    replace_attr(checkpointing, "schedule_async_save", schedule_async_save)
    replace_attr(training, "setup_model_and_optimizer", setup_model_and_optimizer)


def _allocate_pool(whole: bool) -> None:
    """Right after set-up, start allocating in a thread the host pool this rank's saves will take
    (:func:`~megatron_zaya.checkpoint.staging.allocate_pool`; ``whole``: a background save's, else the local tier's),
    the size of its part by the memory plan (:func:`~megatron_zaya.memory_plan.checkpoint_part_bytes`), so that
    the first save does not pay it. A run without the plan's flags (another entry than zaya-pretrain, as
    ``benchmarks/gpt_pretrain.py``) leaves it to the first save."""
    from megatron.core import parallel_state
    from megatron.training import get_args

    from megatron_zaya.checkpoint.staging import allocate_pool
    from megatron_zaya.memory_plan import checkpoint_part_bytes
    from megatron_zaya.training.arguments import memory_plan_inputs

    args = get_args()
    if not hasattr(args, "zaya_preset"):
        return
    fully_parallel = args.ckpt_fully_parallel_save if whole else args.non_persistent_local_ckpt_algo == "fully_parallel"
    part = checkpoint_part_bytes(*memory_plan_inputs(args), parallel_state.get_pipeline_model_parallel_rank(),
                                 fully_parallel)
    allocate_pool(part, whole)


def _fence_copies(model) -> None:
    """Make the model config's ``finalize_model_grads_func`` (called once per step after the last backward,
    before anything writes the saved tensors; Megatron's own when the model set none, as ``train`` would,
    training.py:3549) first wait for the copies of the saves before it
    (:func:`~megatron_zaya.checkpoint.staging.wait_for_copies`); once, whichever tier asks."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    from megatron_zaya.checkpoint.staging import wait_for_copies

    config = get_model_config(model[0])
    finalize = config.finalize_model_grads_func or finalize_model_grads
    if getattr(finalize, "waits_for_copies", False):
        return

    @functools.wraps(finalize)
    def finalize_model_grads_after_copies(*args, **kwargs):
        wait_for_copies()
        return finalize(*args, **kwargs)

    finalize_model_grads_after_copies.waits_for_copies = True
    config.finalize_model_grads_func = finalize_model_grads_after_copies


@register("checkpointing.checksums_while_writing", target="megatron.core.dist_checkpointing.strategies."
          "filesystem_async.FileSystemWriterAsync.get_save_function_and_args")
def checksums_while_writing() -> None:
    """A ``torch_dist`` save's files, synchronous or background, are checksummed (CRC-32) as the writer writes
    them, not read again after.

    Megatron writes every ``torch_dist`` save through the function ``FileSystemWriterAsync`` hands out
    (``get_save_function_and_args``, filesystem_async.py:206): a synchronous save runs it in the training process
    (``AsyncRequest.execute_sync``, async_utils.py:141), a background one in a thread of it
    (``checkpointing.background_saves``) or else in Megatron's writer process. Its threads open each data file with
    the builtin ``open`` and write the items into it (``write_preloaded_data``, filesystem_async.py:403). Rank 0
    then read every file back for ``zaya_checksums.json`` when the tracker was written, and the background writer
    read its files back (11-21 s of a 45-60 s write of the 8-layer model on one H200, docs/benchmarks.md). Two
    replacements: the function handed out is wrapped in
    :func:`~megatron_zaya.checkpoint.format.write_recording_checksums`, which records each rank's sizes and CRC-32
    beside its files; and the name ``open`` in that module (which the function looks up before the builtins) is set
    to :func:`~megatron_zaya.checkpoint.format.open_checksummed`: the builtin, except inside that wrapper, where a
    file opened ``wb`` is wrapped so that each write also updates its CRC-32 (a file that seeks is left to be
    hashed). The tracker's checksums take those records and hash only the files without one (``.metadata``,
    ``metadata.json``) or whose size differs. Megatron's writer process, started with ``forkserver`` on a GPU, does
    not have this module's replacement of ``open``: there the records are made by reading the files once.
    Off: leave ``checkpointing.checksums_while_writing`` out of ``--zaya-patches`` (rank 0 then reads every file
    again when the tracker is written).
    """
    import inspect

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from megatron_zaya.checkpoint.format import open_checksummed, write_recording_checksums

    if "open_file = open" not in inspect.getsource(FileSystemWriterAsync.write_preloaded_data):
        raise PatchError("FileSystemWriterAsync.write_preloaded_data no longer opens its files with open: "
                         f"megatron-core changed under this patch (found {megatron_version()})")
    filesystem_async.open = open_checksummed  # a new module global, found before the builtin
    original = FileSystemWriterAsync.get_save_function_and_args

    @functools.wraps(original)
    def get_save_function_and_args(self):
        write, preload, args = original(self)
        return None if write is None else functools.partial(write_recording_checksums, write), preload, args

    replace_attr(FileSystemWriterAsync, "get_save_function_and_args", get_save_function_and_args)


@register("checkpointing.no_record_crc_in_writes", target="megatron.core.dist_checkpointing.strategies."
          "filesystem_async.FileSystemWriterAsync.write_preloaded_data_multithread")
def no_record_crc_in_writes() -> None:
    """While Megatron's ``torch_dist`` writer runs in this process, ``torch.save`` writes its zip records without
    their CRC-32: the files are checksummed whole as they are written (``checkpointing.checksums_while_writing``).

    Megatron's writer threads ``torch.save`` each tensor into their file (``_write_item``,
    torch/distributed/checkpoint/filesystem.py). ``torch.save`` computes every record's CRC-32 in
    ``PyTorchFileWriter.write_record``, which holds the GIL, so the writer threads take turns for it: 8 threads
    wrote 4 GiB of tensors at 5.8 GB/s with it and 8.7 GB/s without, and a background save of the 8-layer model
    was written in 0.92x the time (docs/benchmarks.md). ``torch.load`` never checks those CRCs, and the integrity
    checks read the files' own (``zaya_checksums.json``). Wraps
    ``FileSystemWriterAsync.write_preloaded_data_multithread`` (filesystem_async.py:253, what a synchronous and a
    background save run) to set torch's ``config.save.compute_crc32`` off while it runs, and back after it; other
    ``torch.save`` calls keep it.
    Off: leave ``checkpointing.no_record_crc_in_writes`` out of ``--zaya-patches``.
    """
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from torch.utils.serialization import config

    original = FileSystemWriterAsync.write_preloaded_data_multithread

    @functools.wraps(original)
    def write_preloaded_data_multithread(*args, **kwargs):
        before, config.save.compute_crc32 = config.save.compute_crc32, False
        try:
            return original(*args, **kwargs)
        finally:
            config.save.compute_crc32 = before

    replace_attr(FileSystemWriterAsync, "write_preloaded_data_multithread",
                 staticmethod(write_preloaded_data_multithread))


@register("checkpointing.async_save_workers", target="megatron.training.checkpointing.TorchDistSaveShardedStrategy")
def async_save_workers() -> None:
    """An ``--async-save`` writes each rank's part with ``--dist-ckpt-workers`` threads, one file each, as the flag
    says.

    ``save_checkpoint`` (checkpointing.py:775) builds ``TorchDistSaveShardedStrategy`` with its default of one
    thread and applies ``--dist-ckpt-workers`` only with ``--ckpt-assume-constant-structure``: otherwise the flag
    is ignored without a word, and one thread writes the whole part into one file. A background save of the
    8-layer model (24 GB in 2,452 items) was written in 12-14 s that way, in 3.3 s by 8 threads (one H100, with
    ``--ckpt-assume-constant-structure``; docs/benchmarks.md). The replacement, a subclass in
    ``megatron.training.checkpointing``'s namespace, takes ``--dist-ckpt-workers`` threads when ``--async-save`` is
    on and the caller names no thread count; synchronous saves keep one, as Megatron wants.
    Off: leave ``checkpointing.async_save_workers`` out of ``--zaya-patches``.
    """
    from megatron.training import checkpointing
    from megatron.training.global_vars import get_args

    class AsyncSaveWorkers(checkpointing.TorchDistSaveShardedStrategy):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            megatron_args = get_args()
            if megatron_args.async_save and "thread_count" not in kwargs:
                self.thread_count = megatron_args.dist_ckpt_workers

    replace_attr(checkpointing, "TorchDistSaveShardedStrategy", AsyncSaveWorkers)


@register("checkpointing.replan_on_new_structure", target="megatron.core.dist_checkpointing.save")
def replan_on_new_structure() -> None:
    """With ``--ckpt-assume-constant-structure`` (which ``--async-save`` implies), a save whose sharded state dict
    differs in structure from the last save's through the same strategy plans it afresh and validates it, on
    every rank, instead of reusing the cached plan.

    The flag keeps the save plan, the ranks' shares of the write and the global metadata from the first save and
    skips the sharding validation after it (checkpointing.py:772; strategies/fully_parallel.py:121,
    state_dict_saver.py:128): a save call of the 8-layer model's structure took 0.69x the time on a CPU, and the
    validation alone 2 x 61-65 ms of a call on an H100's host (docs/benchmarks.md).
    Megatron trusts the caller that nothing changes; a tensor that appears, goes or changes shape would be saved
    with the old plan. Wraps ``megatron.core.dist_checkpointing.save``, which ``save_checkpoint`` calls through the
    module: it compares the keys, shapes, offsets and replicas of the state dict with the last save's, agrees on a
    change across ranks (one all-reduce of a flag, since a rank that re-plans alone would wait for the others),
    and on a change empties the strategy's caches, as a fresh strategy has them, and asks for the validation.
    Off: leave ``checkpointing.replan_on_new_structure`` out of ``--zaya-patches``.
    """
    import weakref

    from megatron.core import dist_checkpointing

    from ..runtime import on_any_rank

    original = dist_checkpointing.save
    last_structure: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @functools.wraps(original)
    def save(sharded_state_dict, checkpoint_dir, sharded_strategy=None, *args, **kwargs):
        if sharded_strategy is not None and _caches_structure(sharded_strategy):
            structure = _sharded_structure(sharded_state_dict)
            last = last_structure.get(sharded_strategy)
            if last is not None and on_any_rank(last != structure):
                _forget_structure(sharded_strategy)
                if args:  # validate_access_integrity, the first argument after the strategy
                    args = (True, *args[1:])
                else:
                    kwargs["validate_access_integrity"] = True
            last_structure[sharded_strategy] = structure
        return original(sharded_state_dict, checkpoint_dir, sharded_strategy, *args, **kwargs)

    replace_attr(dist_checkpointing, "save", save)


@register("checkpointing.validate_once_without_data_parallelism",
          target="megatron.core.dist_checkpointing.strategies.fully_parallel.FullyParallelSaveStrategyWrapper."
                 "apply_saving_parallelization")
def validate_once_without_data_parallelism() -> None:
    """With ``--ckpt-assume-constant-structure``, a fully parallel save validates the sharding at its first save
    only, also where its group has one rank (no data parallelism, e.g. one GPU).

    ``FullyParallelSaveStrategyWrapper.apply_saving_parallelization`` (fully_parallel.py:111-140) validates
    whenever no distribution of the write is cached, and a one-rank group has none to cache: every save gathered
    the sharding metadata over all ranks and validated it again (25 ms of a save call on a CPU, 61-65 ms on an
    H100's host, docs/benchmarks.md). Wraps the method: with caching on and a one-rank group, the calls after the
    first return at once (a one-rank group distributes nothing). ``checkpointing.replan_on_new_structure`` clears
    the mark when the structure changes.
    Off: leave ``checkpointing.validate_once_without_data_parallelism`` out of ``--zaya-patches``.
    """
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.utils import get_pg_size

    original = FullyParallelSaveStrategyWrapper.apply_saving_parallelization

    @functools.wraps(original)
    def apply_saving_parallelization(self, sharded_state_dict) -> None:
        one_rank = get_pg_size(group=self.parallelization_group) <= 1
        if self.do_cache_distribution and one_rank and getattr(self, SHARDING_VALIDATED, False):
            return
        original(self, sharded_state_dict)
        setattr(self, SHARDING_VALIDATED, True)

    replace_attr(FullyParallelSaveStrategyWrapper, "apply_saving_parallelization", apply_saving_parallelization)


SHARDING_VALIDATED = "zaya_sharding_validated"  # set on a save strategy once its sharding was validated


@register("checkpointing.shard_lookup_by_offset", target="torch.distributed.checkpoint.utils._find_shard")
def shard_lookup_by_offset() -> None:
    """A ``torch_dist`` save or load finds each item's shard of a sharded tensor through a table of its shards by
    offset, not by a scan of them all.

    Megatron hands torch one sharded tensor per key with all of a rank's shards of it (an expert weight of every
    expert and layer: 128-256 shards at 8 layers), and torch's save plan names each shard by its offset without
    the index that ``_find_shard`` (checkpoint/utils.py:329) could use, so each lookup scanned the tensor's shards:
    33 ms of the write buckets' 75 ms in a save call of the 8-layer model's structure on a CPU (docs/benchmarks.md).
    Wraps ``_find_shard``, which ``find_tensor_shard`` calls through its module: the table is built once per
    sharded tensor (a save converts its state dict into new ones) and kept on it; an offset not in it goes to
    torch's lookup, which names the missing shard.
    Off: leave ``checkpointing.shard_lookup_by_offset`` out of ``--zaya-patches``.
    """
    from torch.distributed.checkpoint import utils

    original = utils._find_shard

    @functools.wraps(original)
    def _find_shard(tensor, index):
        if index.offset is not None:
            table = getattr(tensor, SHARDS_BY_OFFSET, None)
            if table is None:
                table = {tuple(shard.metadata.shard_offsets): shard for shard in tensor.local_shards()}
                setattr(tensor, SHARDS_BY_OFFSET, table)
            shard = table.get(tuple(index.offset))
            if shard is not None:
                return shard
        return original(tensor, index)

    replace_attr(utils, "_find_shard", _find_shard)


SHARDS_BY_OFFSET = "zaya_shards_by_offset"  # kept on a torch ShardedTensor: its local shards by offset

# The modules that call torch's shard overlap check by the name they imported.
OVERLAP_CHECK_CALLERS = tuple(f"torch.distributed._shard.{name}" for name in (
    "sharding_spec._internals", "sharding_spec.api", "sharded_tensor.api", "sharded_tensor.utils"))


@register("checkpointing.shard_overlap_checked_once",
          target="torch.distributed._shard.sharding_spec._internals.validate_non_overlapping_shards_metadata")
def shard_overlap_checked_once() -> None:
    """torch checks that the shards of a sharded tensor do not overlap once per layout of its shards in a
    process, not at every save and load.

    Each ``torch_dist`` save converts Megatron's state dict into torch sharded tensors, and each conversion
    checks every pair of a tensor's shards for overlap (sharding_spec/_internals.py:28, 91) when they are cut along
    more than one dimension: 103,296 pairs and 40 ms of a save call of the 8-layer model's structure on a CPU, whose
    expert weights come in 128-256 shards (docs/benchmarks.md). The check depends on the shards' offsets and sizes
    alone, and a run saves the same layout again and again. Wraps the check in the modules that call it: a layout
    that passed it (its shards' offsets and sizes) is not checked again; any other is, and fails as before.
    Off: leave ``checkpointing.shard_overlap_checked_once`` out of ``--zaya-patches``.
    """
    import importlib

    from torch.distributed._shard.sharding_spec import _internals

    original = _internals.validate_non_overlapping_shards_metadata
    passed: set[tuple] = set()

    @functools.wraps(original)
    def validate_non_overlapping_shards_metadata(shards) -> None:
        layout = tuple((tuple(shard.shard_offsets), tuple(shard.shard_sizes)) for shard in shards or ())
        if layout in passed:
            return
        original(shards)
        passed.add(layout)

    for name in OVERLAP_CHECK_CALLERS:
        replace_attr(importlib.import_module(name), "validate_non_overlapping_shards_metadata",
                     validate_non_overlapping_shards_metadata)


def _caches_structure(strategy) -> bool:
    """Whether a save strategy (or the fully parallel wrapper around one) reuses a cached structure."""
    base = getattr(strategy, "base_strategy", strategy)
    return bool(getattr(strategy, "do_cache_distribution", False) or getattr(base, "use_cached_ckpt_structure", False))


def _sharded_structure(sharded_state_dict) -> tuple:
    """What a cached save plan depends on: each sharded item's key, place in its global tensor and replica (for a
    factory, which builds its tensors at the save, the shape of what it builds them from)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedObject, ShardedTensor

    structure = []
    for item in nested_values(sharded_state_dict):
        if isinstance(item, ShardedTensor):
            structure.append((item.key, item.dtype, item.local_shape, item.global_shape, item.global_offset,
                              item.axis_fragmentations, item.replica_id))  # fmt: skip
        elif isinstance(item, ShardedObject):
            structure.append((item.key, item.global_shape, item.global_offset, item.replica_id))
        elif isinstance(item, ShardedBase):
            data = getattr(item, "data", None)
            structure.append((type(item).__name__, item.key, item.replica_id,
                              (data.dtype, tuple(data.shape)) if hasattr(data, "shape") else None))  # fmt: skip
    return tuple(structure)


def _forget_structure(strategy) -> None:
    """Empty the caches that ``FullyParallelSaveStrategyWrapper`` and ``TorchDistSaveShardedStrategy`` fill at a
    save (fully_parallel.py:88, torch.py:702-718), as they are in a fresh strategy."""
    if hasattr(strategy, "cached_distribution"):
        strategy.cached_distribution = None
    setattr(strategy, SHARDING_VALIDATED, False)
    base = getattr(strategy, "base_strategy", strategy)
    for name in ("cached_central_plan", "cached_local_plan", "cached_global_metadata"):
        if hasattr(base, name):
            setattr(base, name, None)
    if hasattr(base, "validated_cache_reuse"):
        base.validated_cache_reuse = False
    if hasattr(base, "_metadata_cache"):
        base._metadata_cache = None


@register("checkpointing.one_write_in_flight", target="megatron.training.training.save_checkpoint",
          wraps=("reliability.watchdog_saves",))
def one_write_in_flight() -> None:
    """With ``--async-save``, a save first waits for the background saves in flight and finalizes them, so that
    the checkpoint before it is named (tracker and ``zaya_checksums.json``) before the next one's directory
    and files appear.

    Megatron finalizes a finished background save from the training loop, at the step after the writer reports
    it (``maybe_finalize_async_save``, training.py:3740). The writer takes the next save as soon as it is
    free, while the loop is still in ``save_checkpoint``, so when the next save came before the previous write
    ended, a SIGKILL once the next write had begun left the previous checkpoint written but never named: no
    tracker, and no intact checkpoint to resume from. The loop waited for that write anyway (the next save's
    preload joins the writer, async_utils.py:421); now it also finalizes it first. Wraps the name
    ``save_checkpoint`` that ``megatron.training.training`` imported; calls the queue's own
    ``maybe_finalize_async_calls(blocking=True)`` rather than ``maybe_finalize_async_save``, which prints a line
    at every save that finds a write in flight (each step, with a local tier saving every step). A local-tier
    save does not wait: it writes nothing of ``--save``, and its own thread writes it (its request to Megatron's
    writer does nothing), so a persistent write in flight never holds the in-memory tier back.
    Off: leave ``checkpointing.one_write_in_flight`` out of ``--zaya-patches`` (a kill can then leave the newest
    written checkpoint unnamed).
    """
    import megatron.training.training as training
    from megatron.training import async_utils

    original = training.save_checkpoint

    @functools.wraps(original)
    def save_checkpoint(*args, **kwargs):
        run = training.get_args()
        local = kwargs.get("non_persistent_ckpt") and run.non_persistent_ckpt_type == "local"
        if run.async_save and not local and not async_utils.is_empty_async_queue():
            async_utils._async_calls_queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
        return original(*args, **kwargs)

    replace_attr(training, "save_checkpoint", save_checkpoint)


SAVE_TIMERS = ("save-checkpoint", "save-checkpoint-non-persistent")  # the names save_checkpoint_and_time times


@register("checkpointing.save_timers_on_training_stream", target="megatron.training.training.save_checkpoint_and_time",
          platforms=("cuda", "rocm"))
def save_timers_on_training_stream() -> None:
    """The save timers synchronize the training stream at their start and stop, not the whole device, so that a
    save call can return while its copies to host memory run on their own stream beside the next step.

    Megatron's ``Timer`` calls ``torch.cuda.synchronize()`` at each start and stop (timers.py:152, 165), and
    ``save_checkpoint_and_time`` stops its timer after ``save_checkpoint`` (training.py:3103): that stop waits for
    every copy of a background or local-tier save (``megatron_zaya.checkpoint.staging``) queued by then, which
    nothing reads before the next step's ``finalize_model_grads``; the 8-layer model's 24 GB take 0.5 s on one GPU.
    Wraps ``save_checkpoint_and_time``, which ``train`` looks up in ``megatron.training.training``, to give the two
    save timers (:data:`SAVE_TIMERS`) the class of :func:`time_on_training_stream` before they run. Every other
    timer still synchronizes the device: the one that ends a logged step waits there for copies that outlast it.
    Off: leave ``checkpointing.save_timers_on_training_stream`` out of ``--zaya-patches``.
    """
    import megatron.training.training as training

    original = training.save_checkpoint_and_time

    @functools.wraps(original)
    def save_checkpoint_and_time(*args, **kwargs):
        timers = training.get_timers()
        for name in SAVE_TIMERS:
            time_on_training_stream(timers(name, log_level=0))
        return original(*args, **kwargs)

    replace_attr(training, "save_checkpoint_and_time", save_checkpoint_and_time)


def time_on_training_stream(timer) -> None:
    """Make one of Megatron's timers synchronize ``torch.cuda.current_stream()`` where it synchronized the device.
    Its class is swapped in place: ``Timers`` hands out this one object by name. A timer that is off (Megatron's
    ``DummyTimer``) stays as it is."""
    from megatron.core.timers import Timer

    if type(timer) is Timer:
        timer.__class__ = _training_stream_timer()


@functools.cache
def _training_stream_timer() -> type:
    import time

    import torch
    from megatron.core.timers import Timer

    class TrainingStreamTimer(Timer):
        """Megatron's ``Timer`` (timers.py:143-170) with ``torch.cuda.current_stream().synchronize()`` for
        ``torch.cuda.synchronize()``."""

        def start(self, barrier: bool = False) -> None:
            assert not self._started, "timer has already been started"
            if barrier:
                torch.distributed.barrier(group=self._barrier_group)
            torch.cuda.current_stream().synchronize()
            self._start_time, self._started = time.time(), True

        def stop(self, barrier: bool = False) -> None:
            assert self._started, "timer is not started"
            if barrier:
                torch.distributed.barrier(group=self._barrier_group)
            torch.cuda.current_stream().synchronize()
            elapsed = time.time() - self._start_time
            self._elapsed += elapsed
            self._active_time += elapsed
            self._started = False

    return TrainingStreamTimer


@register("checkpointing.one_writer_per_run", target="megatron.training.training.train",
          wraps=("training_loop.frozen_setup_objects",))
def one_writer_per_run() -> None:
    """With ``--async-save --use-persistent-ckpt-worker``, the background writer that the run's first save started
    also writes the save after the last step, and ends with the run.

    Megatron's ``train`` finalizes the writes in flight at its end and closes the writer
    (``maybe_finalize_async_save(blocking=True, terminate=True)``, training.py:4120); ``pretrain`` then saves
    the last step when it is off the save interval (training.py:1441), which starts a new writer process:
    14.5-17.7 s for the 8-layer model on one H200 (docs/benchmarks.md), before ``pretrain`` closes that one
    (training.py:1514). Wraps the names ``train`` and ``maybe_finalize_async_save`` that
    ``megatron.training.training`` holds: inside ``train`` a terminating call finalizes the writes but leaves
    the writer open; a ``train`` that exits (``sys.exit`` at ``--exit-interval`` or on a signal) closes it on
    its way out, as before, and ``pretrain``'s own call closes it at the end (an error leaves it, a daemon
    process, to end with the trainer, as before).
    Off: leave ``checkpointing.one_writer_per_run`` out of ``--zaya-patches`` (the last save starts a writer).
    """
    import megatron.training.training as training

    original_train, original_finalize = training.train, training.maybe_finalize_async_save
    inside = [False]

    @functools.wraps(original_finalize)
    def maybe_finalize_async_save(blocking: bool = False, terminate: bool = False):
        return original_finalize(blocking=blocking, terminate=terminate and not inside[0])

    @functools.wraps(original_train)
    def train(*args, **kwargs):
        inside[0] = True
        try:
            return original_train(*args, **kwargs)
        except SystemExit:  # every rank leaves together (its writes already finalized): no lone collective
            inside[0] = False
            original_finalize(blocking=True, terminate=True)
            raise
        finally:
            inside[0] = False

    replace_attr(training, "maybe_finalize_async_save", maybe_finalize_async_save)
    replace_attr(training, "train", train)


@register("checkpointing.loss_curve_at_saves", target="megatron.training.training.save_checkpoint",
          wraps=("checkpointing.one_write_in_flight",))
def loss_curve_at_saves() -> None:
    """At each checkpoint save, write the loss curve's CSV up to that step, so that a run that crashes or hangs
    keeps the curve of the steps its checkpoints hold, and a restart carries it on.

    Otherwise the curve is written at the end of the run (or at a clean early stop) only. Wraps the name
    ``save_checkpoint`` that ``megatron.training.training`` imported, outside the other save patches. Every rank
    pools its losses, as every rank saves, and the curve is written before the save: written after it, a kill
    between the save's tracker update and the CSV left a checkpoint whose steps the curve lacked. A curve ahead of
    the newest checkpoint (the save then failed, or was killed) is harmless: a resumed run replaces the points it
    repeats. Before the save, the losses' read-back also waits for no copy the save queues.
    Off: leave ``checkpointing.loss_curve_at_saves`` out of ``--zaya-patches`` (a crash then loses the curve of
    its launch).
    """
    import megatron.training.training as training

    from megatron_zaya.training.loss_curve import LOSS_CURVE

    original = training.save_checkpoint

    @functools.wraps(original)
    def save_checkpoint(*args, **kwargs):
        LOSS_CURVE.pool_for_save()
        LOSS_CURVE.save_csv()
        return original(*args, **kwargs)

    replace_attr(training, "save_checkpoint", save_checkpoint)


@register("checkpointing.in_process_write_results",
          target="megatron.core.dist_checkpointing.strategies.filesystem_async.get_write_results_queue")
def in_process_write_results() -> None:
    """A synchronous ``torch_dist`` save hands its write results back through a ``queue.Queue`` of the training
    process, not through a multiprocessing manager.

    Such a save writes in threads of the training process (``write_preloaded_data_multithread``), yet Megatron
    collects their results through a ``Manager().Queue()`` that it creates with ``spawn`` at the first save
    (filesystem_async.py:65): a server process that re-imports the training script, torch and Megatron. That
    costs 4-5 s and a CPU core at the first save of every run, and about 1 s at exit, when the manager is shut
    down. A background writer needs the cross-process queue, which Megatron creates with ``fork`` when it starts
    the writer (async_utils.py:104); that call, and any later one while that queue exists, are unchanged.
    Off: leave ``checkpointing.in_process_write_results`` out of ``--zaya-patches``.
    """
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    original = filesystem_async.get_write_results_queue
    in_process: queue.Queue = queue.Queue()

    @functools.wraps(original)
    def get_write_results_queue(mp_mode: str | None = None):
        if mp_mode is not None:
            return original(mp_mode)
        return in_process if filesystem_async._results_queue is None else original()

    replace_attr(filesystem_async, "get_write_results_queue", get_write_results_queue)


@register("checkpointing.local_tier", target="megatron.training.training.setup_model_and_optimizer")
def local_tier() -> None:
    """``--non-persistent-ckpt-type local`` (and the in-memory tier, ``--zaya-memory-ckpt-interval``, which sets
    it) saves through ZAYA1's :class:`~megatron_zaya.checkpoint.local_tier.LocalTier`, without NVIDIA's
    resiliency package (which ROCm images lack), in a thread of the training process that copies the tensors
    to host memory beside the next step.

    Megatron's local type takes its manager from the checkpointing context (``local_checkpoint_manager``:
    ``save``, ``find_latest``, ``load``; checkpointing.py:629, 940, 1491, 1529) and fills that slot with the
    resiliency package's, importing it in three places. Each is replaced for the local type only:
    ``validate_args`` (arguments.py:399) runs with the type hidden from its import check;
    ``pretrain`` (training.py:1193) gets a config without it, so that it builds an empty context;
    ``setup_model_and_optimizer``, which receives that context before the first load, puts a ``LocalTier`` into
    it; and ``MCoreTensorAwareStateDict.from_state_dict``, Megatron's own conversion of a rank's state that the
    package only gives a base class, runs without its ``HAVE_NVRX`` guard (tensor_aware_state_dict.py:127).
    ``setup_model_and_optimizer`` also drops the part the tier loaded (Megatron has taken its values by then; kept,
    it was a second copy of the state on the device) and starts allocating the tier's host pool in a thread
    (:func:`_allocate_pool`): the first save's call paid 13.6 s for it on one H200.
    A save returns while its thread copies and writes, so two more hooks: the model config's
    ``finalize_model_grads_func`` first waits for the copies of the save before it (:func:`_fence_copies`); and
    ``maybe_finalize_async_save`` called blocking (at the end of ``train``, whatever ends it, and of
    ``pretrain``) first waits for the save in flight, so that a run ends with its last part written.
    Off: leave ``checkpointing.local_tier`` out of ``--zaya-patches`` (the local type then needs the package).
    """
    import megatron.training
    from megatron.core.dist_checkpointing import tensor_aware_state_dict
    from megatron.training import arguments, get_args, training

    from megatron_zaya.checkpoint.local_tier import tier_for

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
    tiers = []  # the tier this process saves through

    @functools.wraps(original_setup)
    def setup_model_and_optimizer(*rest, checkpointing_context=None, **kwargs):
        args = get_args()
        local = args.non_persistent_ckpt_type == "local" and checkpointing_context is not None
        if local:
            tiers.append(checkpointing_context.setdefault("local_checkpoint_manager", tier_for(args)))
        model, *others = original_setup(*rest, checkpointing_context=checkpointing_context, **kwargs)
        if local:
            tiers[-1].done_loading()
            _fence_copies(model)
            _allocate_pool(whole=False)
        return (model, *others)

    original_finalize = training.maybe_finalize_async_save

    @functools.wraps(original_finalize)
    def maybe_finalize_async_save(blocking: bool = False, terminate: bool = False):
        for tier in tiers if blocking else ():
            tier.finish()
        return original_finalize(blocking=blocking, terminate=terminate)

    replace_attr(arguments, "validate_args", validate_args)
    for module in (megatron.training, training):
        replace_attr(module, "pretrain", pretrain)
    replace_attr(training, "setup_model_and_optimizer", setup_model_and_optimizer)
    replace_attr(training, "maybe_finalize_async_save", maybe_finalize_async_save)
    replace_attr(tensor_aware_state_dict, "HAVE_NVRX", True)
