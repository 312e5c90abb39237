"""Patch group ``reliability``: crash-safe, checksummed ``latest`` markers, resuming from the newest intact
checkpoint, the per-step fault guard, clear save failures.

What each fault does and how it is tested: ``docs/reliability.md``.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from .registry import register, replace_attr


class _AtomicTrackerStorage:
    """Megatron's ``maybe_msc`` storage front, except that writing the tracker file is atomic."""

    def __init__(self, storage):
        self._storage = storage

    def __getattr__(self, name):
        return getattr(self._storage, name)

    def open(self, path, mode="r", *args, **kwargs):
        from megatron.core.msc_utils import MultiStorageClientFeature

        from megatron_zaya.checkpoint.format import TRACKER, AtomicTracker

        if mode == "w" and Path(str(path)).name == TRACKER and not MultiStorageClientFeature.is_enabled():
            return AtomicTracker(str(path))
        return self._storage.open(path, mode, *args, **kwargs)


@register("reliability.atomic_tracker", target="megatron.training.checkpointing.maybe_msc")
def atomic_tracker() -> None:
    """Write ``latest_checkpointed_iteration.txt`` atomically (temporary file, fsync, rename), after the
    checksums of the checkpoint it names.

    Megatron rewrites the tracker in place (``open(tracker, 'w')`` then ``write``, checkpointing.py:1011):
    a SIGKILL or node failure between the truncation and the write leaves it empty, and the next launch's
    ``read_metadata`` then ``sys.exit()``s with status 0 and "Invalid metadata file" instead of loading
    the previous checkpoint. The replacement wraps the module's ``maybe_msc`` storage front so that only
    a write-mode ``open`` of the tracker on a local filesystem goes through a staged file renamed over
    the old one; everything else (and multi-storage-client paths) is untouched. The tracker is written
    after every rank finished its checkpoint files (for ``--async-save``: when Megatron finalizes the
    background write), so it names a complete checkpoint; before it, every byte range the checkpoint's
    ``.metadata`` records is checked to lie in its file (``checkpoint.format.check_written``: else the save fails and
    the tracker stays), then the size and CRC-32 of each file go into ``zaya_checksums.json`` (hashed in
    parallel threads, or taken from the records the writers made as they wrote them; written atomically), which
    ``reliability.verified_load`` checks on the next load.
    Off: leave ``reliability`` out of ``--zaya-patches`` / ``ZAYA_PATCHES``.
    """
    from megatron.training import checkpointing

    if not isinstance(checkpointing.maybe_msc, _AtomicTrackerStorage):
        replace_attr(checkpointing, "maybe_msc", _AtomicTrackerStorage(checkpointing.maybe_msc))


@register("reliability.verified_load", target="megatron.training.checkpointing.read_metadata")
def verified_load() -> None:
    """Load the newest intact checkpoint: the tracker's if its files match their checksums, else an older one.

    Megatron's ``read_metadata`` (checkpointing.py:353) turns the tracker file into the iteration to load and
    trusts the files of that checkpoint: flipped bytes in a shard load silently (training continues on
    damaged weights and saves over them), a truncated shard or a garbage ``.metadata``/``metadata.json``
    fails with a traceback, and an empty or garbage tracker ``sys.exit()``s with status 0. The replacement
    returns the iteration chosen by :func:`~megatron_zaya.checkpoint.integrity.newest_intact_checkpoint`:
    every rank checks its share of the files (sizes, then CRC-32 in parallel threads) against
    ``zaya_checksums.json``, the ranks gather their findings, and a damaged checkpoint is named in one line
    and skipped for the newest older intact one; with none intact the run stops, exit 2. Megatron calls
    ``read_metadata`` on every rank at the same points (the original all-reduces the iteration), so the
    check is collective there too; its result is kept per directory and tracker content. When the local or
    in-memory tier has chosen a newer iteration, the persistent checkpoint is not read. Checkpoints
    without checksums (older saves) load as before when the tracker names them. Multi-storage-client paths
    keep the original. Megatron's own ``--verify-integrity`` hashes every file with SHA-256 on rank 0 alone
    and stops on a mismatch; this one is parallel and falls back.
    Off: leave ``reliability`` out of ``--zaya-patches`` / ``ZAYA_PATCHES``.
    """
    from megatron.core.msc_utils import MultiStorageClientFeature
    from megatron.training import checkpointing

    from megatron_zaya.checkpoint.format import read_tracker
    from megatron_zaya.checkpoint.integrity import newest_intact_checkpoint
    from megatron_zaya.checkpoint.local_tier import loading

    original = checkpointing.read_metadata
    chosen: dict[tuple[str, str | None], str] = {}

    @functools.wraps(original)
    def read_metadata(tracker_filename):
        if MultiStorageClientFeature.is_enabled():
            return original(tracker_filename)
        load_dir = os.path.dirname(tracker_filename)
        key = (os.path.abspath(load_dir), read_tracker(load_dir))
        if key not in chosen:
            chosen[key] = newest_intact_checkpoint(load_dir, loading())
        return (0, True) if chosen[key] == "release" else (int(chosen[key]), False)

    replace_attr(checkpointing, "read_metadata", read_metadata)


@register("reliability.checkpoint_fits_run", target="megatron.training.checkpointing._load_base_checkpoint")
def checkpoint_fits_run() -> None:
    """Check the checkpoint a run loads against the run's flags, once the verified load has chosen it.

    Megatron's ``load_checkpoint`` first reads the chosen checkpoint's common state (``_load_base_checkpoint``
    with ``rank0=True``, on every rank; its saved ``args``), then loads the model and optimizer state into the
    built model. A checkpoint of another architecture then fails on shapes, one of another optimizer with a
    40-line traceback about ``param_groups``, and one of another tokenizer loads silently. The wrapper hands the
    saved ``args`` to :func:`~megatron_zaya.checkpoint.fits.check_checkpoint_fits`, which names the
    mismatch and its fix in one line (exit 2). Only for runs with the ``--zaya-*`` flags (zaya-pretrain).
    Off: leave ``reliability`` out of ``--zaya-patches`` / ``ZAYA_PATCHES``.
    """
    from megatron.training import checkpointing

    from megatron_zaya.checkpoint.fits import check_checkpoint_fits

    original = checkpointing._load_base_checkpoint

    @functools.wraps(original)
    def _load_base_checkpoint(load_dir, args, *rest, **kwargs):
        loaded = original(load_dir, args, *rest, **kwargs)
        state_dict, _, release = loaded[:3]
        if kwargs.get("rank0") and state_dict is not None and hasattr(args, "zaya_tokenizer"):
            check_checkpoint_fits(state_dict.get("args"), load_dir, release, args)
        return loaded

    replace_attr(checkpointing, "_load_base_checkpoint", _load_base_checkpoint)


@register("reliability.step_guard", target="megatron.training.training.get_megatron_optimizer",
          wraps=("optim.zaya_muon",))
def step_guard() -> None:
    """Install megatron-zaya's :class:`~megatron_zaya.training.reliability.StepGuard` on the optimizer.

    Wraps the name ``get_megatron_optimizer`` that ``setup_model_and_optimizer`` calls: the optimizer it
    returns gets its ``prepare_grads`` wrapped so that a step whose global loss or grad norm is not finite
    is skipped before any update (Megatron's own skip path: ``update_successful=False``, counted as a
    skipped iteration, LR schedule not advanced), the balancing-bias update of that step is undone,
    ``--zaya-max-nonfinite-steps`` in a row stop the run, and data-parallel replicas are compared every
    ``--zaya-replica-check-interval`` steps. Only for runs with the ``--zaya-*`` flags (zaya-pretrain).
    Off: leave ``reliability`` out of ``--zaya-patches`` / ``ZAYA_PATCHES`` (non-finite steps then update
    the weights, as in stock Megatron without fp16 loss scaling).
    """
    import megatron.training.training as training
    from megatron.training import global_vars

    from megatron_zaya.training.reliability import GUARD

    original = training.get_megatron_optimizer

    @functools.wraps(original)
    def get_megatron_optimizer(config, model_chunks, *args, **kwargs):
        optimizer = original(config, model_chunks, *args, **kwargs)
        # Megatron's global args exist only inside pretrain(); library callers build optimizers without them.
        flags = global_vars._GLOBAL_ARGS
        if hasattr(flags, "zaya_max_nonfinite_steps"):
            GUARD.install(optimizer, model_chunks, flags)
        return optimizer

    replace_attr(training, "get_megatron_optimizer", get_megatron_optimizer)


@register("reliability.save_failure", target="megatron.training.training.save_checkpoint")
def save_failure() -> None:
    """Turn a failing checkpoint save (disk full, permissions, I/O error) into one clear line, and remove what
    the failed save wrote.

    Wraps the name ``save_checkpoint`` that ``megatron.training.training`` imported: an exception raised
    while saving becomes the ``TrainingFault`` of :func:`~megatron_zaya.checkpoint.save_failures.failed_save`,
    naming the error (a full disk as such), the save directory and the previous checkpoint, which stays loadable
    because the ``latest`` marker is only replaced after a complete save (``reliability.atomic_tracker``). The
    failed save's step directory, which ``latest`` does not name, is removed: on a full disk it is what fills it.
    zaya-pretrain prints the line as ``zaya-pretrain: error: ...``, exit 3.
    Off: leave ``reliability`` out of ``--zaya-patches`` / ``ZAYA_PATCHES`` (Megatron's traceback then).
    """
    import megatron.training.training as training
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_zaya.checkpoint.save_failures import failed_save

    original = training.save_checkpoint

    @functools.wraps(original)
    def save_checkpoint(iteration, *args, **kwargs):
        try:
            return original(iteration, *args, **kwargs)
        except (Exception, CheckpointException) as error:  # torch's CheckpointException is a BaseException
            raise failed_save(error, iteration, training.get_args().save) from error

    replace_attr(training, "save_checkpoint", save_checkpoint)


def _pause_the_watchdog_in(name: str) -> None:
    """Replace the function ``name`` that ``megatron.training.training`` imported by the same call with the progress
    watchdog paused."""
    import megatron.training.training as training

    from megatron_zaya.training.watchdog import WATCHDOG

    original = getattr(training, name)

    @functools.wraps(original)
    def paused(*args, **kwargs):
        with WATCHDOG.paused():
            return original(*args, **kwargs)

    replace_attr(training, name, paused)


@register("reliability.watchdog_loads", target="megatron.training.training.load_checkpoint")
def watchdog_loads() -> None:
    """Give the checkpoint load at start-up its own allowance under ``--zaya-watchdog-seconds``, as saves have: the
    progress watchdog starts with the optimizer, before Megatron loads the checkpoint into it, and a load of a large
    model from shared storage can take longer than the allowance before the first step (10 T); a restart would only
    load it again.

    Wraps the name ``load_checkpoint`` that ``megatron.training.training`` imported (``setup_model_and_optimizer``
    calls it). Off: leave ``reliability.watchdog_loads`` out of ``--zaya-patches`` (a load longer than the allowance
    then counts as a hang).
    """
    _pause_the_watchdog_in("load_checkpoint")


@register("reliability.watchdog_saves", target="megatron.training.training.save_checkpoint",
          wraps=("reliability.save_failure",))
def watchdog_saves() -> None:
    """Give checkpoint saves their own allowance under ``--zaya-watchdog-seconds``: the progress watchdog declares
    no hang while a save runs (a save of a large model takes minutes where a step takes seconds).

    Wraps the name ``save_checkpoint`` that ``megatron.training.training`` imported, around
    ``reliability.save_failure``: the pause covers whatever runs inside. Off: leave ``reliability.watchdog_saves``
    out of ``--zaya-patches`` (a save longer than the watchdog's allowance then counts as a hang).
    """
    _pause_the_watchdog_in("save_checkpoint")
