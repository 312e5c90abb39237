"""ZAYA1's local checkpoint tier on two gloo ranks: each rank writes its own part, keeps its newest two, and a
resume takes the newest iteration intact on every rank of the same layout; a damaged or missing part falls
back to an older one, and a newer checkpoint of another layout is refused.

The state is Megatron's own ``MCoreTensorAwareStateDict`` of a sharded state dict with a tensor sharded over
the ranks and one replicated over them (``fully_parallel``: one rank writes it, the load exchanges it).
"""

from __future__ import annotations

import contextlib
import io
import shutil

import pytest
import torch
from gloo import run_ranks

from megatron_zaya.errors import UsageError


def _sharded_state(iteration: int, rank: int, world: int, fill: bool = True):
    from megatron.core.dist_checkpointing import ShardedTensor

    def values(base):
        return torch.arange(4, dtype=torch.float32) + base if fill else torch.zeros(4)

    return {
        "sharded": ShardedTensor.from_rank_offsets("sharded", values(100 * iteration + 10 * rank), (0, rank, world)),
        "replicated": ShardedTensor.from_rank_offsets("replicated", values(100 * iteration), replica_id=rank),
        "iteration": iteration,
    }


def _tier_on_ranks(rank, world, root, saves):
    """Save ``saves`` (iterations), then resume: ``((find_latest, the loaded state's values), what it printed to
    stderr)``, or the refusal's message (the ranks' own stderr is the forkserver's, not the test's)."""
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        result = _save_and_resume(rank, world, root, saves)
    return result if isinstance(result, str) else (result, printed.getvalue())


def _save_and_resume(rank, world, root, saves):
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    from megatron_zaya.patches import apply_patches
    from megatron_zaya.checkpoint.local_tier import LocalTier

    apply_patches("cpu,checkpointing.local_tier")
    ps.initialize_model_parallel()
    try:
        group = ps.get_data_parallel_group(with_context_parallel=True)
        for iteration in saves:
            state, _ = MCoreTensorAwareStateDict.from_state_dict(
                _sharded_state(iteration, rank, world), algo="fully_parallel", parallelization_group=group)
            LocalTier(root, 2, None).save(state, iteration, is_async=False)
        tier = LocalTier(root, 2, None)
        try:
            latest = tier.find_latest()
        except UsageError as error:
            return str(error)
        if latest < 0:
            return latest, None
        state, _ = tier.load()
        loaded = state.to_state_dict(_sharded_state(latest, rank, world, fill=False), algo="fully_parallel",
                                     parallelization_group=group)
        return latest, {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in loaded.items()}
    finally:
        ps.destroy_model_parallel()


def _flip(path):
    data = bytearray(path.read_bytes())
    data[-64:-56] = bytes(b ^ 0xFF for b in data[-64:-56])
    path.write_bytes(bytes(data))


def test_local_tier_keeps_the_newest_intact_and_refuses_another_layout(tmp_path):
    root = tmp_path / "local"
    results = run_ranks(_tier_on_ranks, 2, tmp_path, str(root), [1, 2, 3, 4])
    for rank, ((latest, loaded), _) in enumerate(results):
        assert latest == 4
        assert loaded == {"sharded": [400.0 + 10 * rank + i for i in range(4)],
                          "replicated": [400.0 + i for i in range(4)], "iteration": 4}
    # Two kept per rank; the replicated tensor's data is in one rank's part only (fully_parallel).
    assert sorted(p.relative_to(root).as_posix() for p in root.glob("iter_*/rank_*")) == [
        "iter_0000003/rank_00000", "iter_0000003/rank_00001", "iter_0000004/rank_00000", "iter_0000004/rank_00001"]

    _flip(root / "iter_0000004" / "rank_00001" / "state.pt")  # damage on one rank: 3, intact on both
    ((latest, loaded), printed), _ = run_ranks(_tier_on_ranks, 2, tmp_path / "damaged", str(root), [])
    assert latest == 3 and loaded["sharded"] == [300.0, 301.0, 302.0, 303.0] and loaded["iteration"] == 3
    warning = [line for line in printed.splitlines() if "zaya-pretrain: warning:" in line]
    assert warning == [f"zaya-pretrain: warning: local checkpoint {root}/iter_0000004 is damaged (rank 1: state.pt "
                       "differs from its checksum at save); skipped"], warning

    shutil.rmtree(root / "iter_0000003" / "rank_00001")  # rank 1's node replaced: nothing left on both
    ((latest, _), printed), _ = run_ranks(_tier_on_ranks, 2, tmp_path / "replaced", str(root), [])
    assert latest == -1
    assert f"local checkpoint {root}/iter_0000003 is incomplete (no part from rank 1); skipped" in printed

    shutil.rmtree(root)  # saved by 2 ranks, resumed by 1: refused, whatever the persistent tier holds
    run_ranks(_tier_on_ranks, 2, tmp_path / "two", str(root), [5])
    [refusal] = run_ranks(_tier_on_ranks, 1, tmp_path / "one", str(root), [])
    assert refusal.startswith(f"--non-persistent-local-ckpt-dir {root} holds iteration 5, newer than the persistent "
                              "checkpoint (none), saved with another world size or parallel layout"), refusal


def _background_save_then_step(rank, world, root):
    """A background save of a state whose common part holds a live tensor (as the optimizer's step counts are),
    that tensor changed in place before the writer runs (training goes on; Megatron's queue pickles the request
    later, from a thread); then the part loaded back."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    from megatron_zaya.patches import apply_patches
    from megatron_zaya.checkpoint.local_tier import LocalTier

    apply_patches("cpu,checkpointing.local_tier")
    ps.initialize_model_parallel()
    try:
        group = ps.get_data_parallel_group(with_context_parallel=True)
        step = torch.tensor(7.0)
        state, _ = MCoreTensorAwareStateDict.from_state_dict(
            {**_sharded_state(7, rank, world), "step": step}, algo="fully_parallel", parallelization_group=group)
        request = LocalTier(root, 2, None).save(state, 7, is_async=True)
        step += 1  # the next optimizer step
        request.async_fn(*request.async_fn_args[:1], request.preload_fn(), *request.async_fn_args[2:])
        for finalize in request.finalize_fns:
            finalize()
        loaded, _ = LocalTier(root, 2, None).load()
        template = {**_sharded_state(7, rank, world, fill=False), "step": None}
        return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in
                loaded.to_state_dict(template, algo="fully_parallel", parallelization_group=group).items()}
    finally:
        ps.destroy_model_parallel()


def test_a_background_save_keeps_the_state_of_its_step(tmp_path):
    (loaded,) = run_ranks(_background_save_then_step, 1, tmp_path, str(tmp_path / "local"))
    assert loaded["step"] == 7.0 and loaded["iteration"] == 7, loaded
    assert loaded["sharded"] == [700.0, 701.0, 702.0, 703.0], loaded
