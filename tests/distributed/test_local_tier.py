"""ZAYA1's local checkpoint tier on two gloo ranks: each rank writes its own part, keeps its newest two, and a
resume takes the newest iteration intact on every rank of the same layout; a damaged or missing part falls
back to an older one, and a newer checkpoint of another layout is refused; once loaded, the tier lets the part go.

The state is Megatron's own ``MCoreTensorAwareStateDict`` of a sharded state dict with a tensor sharded over
the ranks and one replicated over them (``fully_parallel``: one rank writes it, the load exchanges it).
"""

from __future__ import annotations

import contextlib
import gc
import io
import shutil
import threading
import weakref
from pathlib import Path

import pytest
import torch
from gloo import run_ranks

from megatron_zaya.checkpoint import CHECKSUMS
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


def _save_and_resume(rank, world, root, saves, peer=False, flips=(), is_async=False):
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    from megatron_zaya.patches import apply_patches
    from megatron_zaya.checkpoint.local_tier import LocalTier

    apply_patches("cpu,checkpointing.local_tier")
    ps.initialize_model_parallel()
    try:
        group = ps.get_data_parallel_group(with_context_parallel=True)
        tier = LocalTier(root, 2, None, peer)
        for iteration in saves:
            state, _ = MCoreTensorAwareStateDict.from_state_dict(
                _sharded_state(iteration, rank, world), algo="fully_parallel", parallelization_group=group)
            request = tier.save(state, iteration, is_async=is_async)
            assert request is None if not is_async else request.async_fn.__name__ == "_written_by_the_tier"
            _next_step(state)
        tier.finish()
        torch.distributed.barrier()
        for path in flips if rank == 0 else ():
            _flip(Path(path))
        torch.distributed.barrier()
        tier = LocalTier(root, 2, None, peer)
        try:
            latest = tier.find_latest()
        except UsageError as error:
            return str(error)
        if latest < 0:
            return latest, None
        state, _ = tier.load()
        loaded = state.to_state_dict(_sharded_state(latest, rank, world, fill=False), algo="fully_parallel",
                                     parallelization_group=group)
        values = {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in loaded.items()}
        held = weakref.ref(loaded["sharded"])
        del state, loaded  # what Megatron keeps of them once it has copied the values: nothing
        assert held() is not None  # the tier holds the part until set-up's end says it is done loading
        tier.done_loading()
        gc.collect()
        assert held() is None
        return latest, values
    finally:
        ps.destroy_model_parallel()


def _next_step(state) -> None:
    """What training does after a save: wait for its copies, then change every saved tensor in place."""
    from megatron_zaya.checkpoint.staging import wait_for_copies

    wait_for_copies()
    tensors = state.pop_tensors()
    for tensor in tensors:
        tensor.mul_(-1).sub_(1)
    state.insert_tensors(tensors)


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

    # Damage on both ranks (rank 0's found as its data is read back, rank 1's before): 3, intact on both.
    _flip(root / "iter_0000004" / "rank_00000" / "tensors.000.bin")
    _flip(root / "iter_0000004" / "rank_00001" / "state.pt")
    ((latest, loaded), printed), ((latest_1, loaded_1), _) = run_ranks(_tier_on_ranks, 2, tmp_path / "damaged",
                                                                       str(root), [])
    assert latest == latest_1 == 3 and loaded["iteration"] == 3, (loaded, printed)
    assert loaded["sharded"] == [300.0, 301.0, 302.0, 303.0] and loaded_1["sharded"] == [310.0, 311.0, 312.0, 313.0]
    assert loaded["replicated"] == loaded_1["replicated"] == [300.0, 301.0, 302.0, 303.0]
    warning = [line for line in printed.splitlines() if "zaya-pretrain: warning:" in line]
    assert warning == [f"zaya-pretrain: warning: local checkpoint {root}/iter_0000004 is damaged (rank 0: "
                       "tensors.000.bin differs from its checksum at save and 1 more); skipped"], warning

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
    """A save of a state whose common part holds a live tensor (as the optimizer's step counts are), that
    tensor and the saved tensors changed in place while the tier's thread writes; then the part loaded back."""
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
        tier = LocalTier(root, 2, None)
        tier.save(state, 7, is_async=True)
        step += 1  # the next optimizer step, before the part is written
        _next_step(state)
        tier.finish()
        loaded, _ = LocalTier(root, 2, None).load()
        template = {**_sharded_state(7, rank, world, fill=False), "step": None}
        return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in
                loaded.to_state_dict(template, algo="fully_parallel", parallelization_group=group).items()}
    finally:
        ps.destroy_model_parallel()


def test_a_save_keeps_the_state_of_its_step(tmp_path):
    (loaded,) = run_ranks(_background_save_then_step, 1, tmp_path, str(tmp_path / "local"))
    assert loaded["step"] == 7.0 and loaded["iteration"] == 7, loaded
    assert loaded["sharded"] == [700.0, 701.0, 702.0, 703.0], loaded


def _unmakeable_part_then_prune(rank, world, root):
    """A file where iteration 1's directory goes: its part cannot be made, so the save fails before its copies.
    Returns whether the training loop's wait for them returned (within 60 s, not never), the error ``finish``
    raised, and the directories left after iteration 2 is saved, its prune having found the empty directories
    of iteration 1 and of iteration 3 (what another rank's next save on this node makes before its part)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    from megatron_zaya.checkpoint.local_tier import LocalTier
    from megatron_zaya.checkpoint.staging import wait_for_copies
    from megatron_zaya.patches import apply_patches

    apply_patches("cpu,checkpointing.local_tier")
    ps.initialize_model_parallel()
    try:
        group, root = ps.get_data_parallel_group(with_context_parallel=True), Path(root)
        root.mkdir()
        (root / "iter_0000001").write_text("a file, not a directory")
        tier = LocalTier(str(root), 2, None)
        state, _ = MCoreTensorAwareStateDict.from_state_dict(
            _sharded_state(1, rank, world), algo="fully_parallel", parallelization_group=group)
        tier.save(state, 1, is_async=False)
        waiting = threading.Thread(target=wait_for_copies, daemon=True)
        waiting.start()
        waiting.join(60)
        try:
            tier.finish()
            error = None
        except OSError as raised:
            error = type(raised).__name__
        (root / "iter_0000001").unlink()
        (root / "iter_0000001").mkdir()
        (root / "iter_0000003").mkdir()
        state, _ = MCoreTensorAwareStateDict.from_state_dict(
            _sharded_state(2, rank, world), algo="fully_parallel", parallelization_group=group)
        tier.save(state, 2, is_async=False)
        _next_step(state)
        tier.finish()
        return not waiting.is_alive(), error, sorted(p.name for p in root.iterdir())
    finally:
        ps.destroy_model_parallel()


def test_a_save_failing_before_its_copies_releases_the_loop_and_a_prune_spares_newer_directories(tmp_path):
    (result,) = run_ranks(_unmakeable_part_then_prune, 1, tmp_path, str(tmp_path / "local"))
    assert result == (True, "NotADirectoryError", ["iter_0000002", "iter_0000003"]), result


def _save_while_the_other_rank_is_gone(rank, world, root):
    """Rank 1 stops taking part after the tier's group is made (as a rank that died would); rank 0 saves with
    Megatron's collective timeout set to 1.2 s: the error of its save's collectives, raised by ``finish``."""
    from types import SimpleNamespace

    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    from megatron_zaya.checkpoint.local_tier import tier_for
    from megatron_zaya.patches import apply_patches

    apply_patches("cpu,checkpointing.local_tier")
    ps.initialize_model_parallel()
    state, _ = MCoreTensorAwareStateDict.from_state_dict(  # collective
        _sharded_state(1, rank, world), algo="fully_parallel", parallelization_group=ps.get_data_parallel_group())
    result = None
    if rank == 1:
        torch.distributed.new_group(backend="gloo")  # collective: the tier's group, made in rank 0's first save
    else:
        args = SimpleNamespace(zaya_memory_ckpt_interval=0, zaya_local_ckpt_keep=2, non_persistent_local_ckpt_dir=root,
                               load=None, distributed_timeout_minutes=0.02)
        tier = tier_for(args)
        tier.save(state, 1, is_async=False)
        try:
            tier.finish()
            result = "finished"
        except RuntimeError as error:
            result = type(error).__name__
    torch.distributed.barrier()  # the default group, untouched by the tier's failure
    ps.destroy_model_parallel()
    return result


def test_a_save_whose_peer_is_gone_fails_within_the_collective_timeout(tmp_path):
    """The tier's thread waits for the other ranks no longer than Megatron's ``--distributed-timeout-minutes``
    (gloo's own default is 30 minutes): the training loop gets the error at its next save or at the end."""
    result, _ = run_ranks(_save_while_the_other_rank_is_gone, 2, tmp_path, str(tmp_path / "local"))
    assert result not in (None, "finished"), result


def _memory_tier_on_nodes(rank, world, root, saves, flips, is_async):
    """Each rank a node of its own (``LOCAL_WORLD_SIZE`` 1) with its own directory ``root/node<rank>``: save
    ``saves`` (``is_async``: as with ``--async-save``) with copies on the other node (sent from the tier's
    thread), damage the files ``flips`` (relative to ``root``), then resume: ``((find_latest, the loaded state's
    values), what it printed)``."""
    import os

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed), contextlib.redirect_stdout(printed):
        result = _save_and_resume(rank, world, f"{root}/node{rank}", saves, peer=True,
                                  flips=[f"{root}/{f}" for f in flips], is_async=is_async)
    return result, printed.getvalue()


def test_the_memory_tier_survives_a_lost_node_and_a_damaged_part(tmp_path):
    """Two "nodes" of one rank: each keeps its newest two parts and the other's copies; after node 1 is replaced
    (its memory empty) the resume takes rank 1's part from node 0's copy, exactly; a damaged part is taken from
    its copy (sent by a save under ``--async-save``), and without an intact copy the iteration is skipped for the newest
    intact one; a save removes the complete parts newer than it (a run started afresh)."""
    root = tmp_path / "mem"

    def resumed(name, saves=(), flips=(), is_async=False):
        results = run_ranks(_memory_tier_on_nodes, 2, tmp_path / name, str(root), list(saves), list(flips),
                            is_async)
        for rank, ((latest, loaded), _) in enumerate(results):
            assert loaded == {"sharded": [100.0 * latest + 10 * rank + i for i in range(4)],
                              "replicated": [100.0 * latest + i for i in range(4)], "iteration": latest}, loaded
        phases = [line for line in results[0][1].splitlines() if "[zaya] local checkpoint found and read in" in line]
        assert len(phases) == 1 and "of tensors read and checked in" in phases[0], results[0][1]  # rank 0's
        return results[0][0][0], results[0][1]

    assert resumed("saved", [1, 2, 3])[0] == 3
    for node in ("node0", "node1"):
        assert sorted(p.relative_to(root / node).as_posix() for p in (root / node).glob("iter_*/rank_*")) == [
            f"iter_000000{i}/rank_0000{r}" for i in (2, 3) for r in (0, 1)]

    shutil.rmtree(root / "node1")  # node 1 replaced
    latest, printed = resumed("replaced")
    assert latest == 3 and (f"local checkpoint {root}/node0/iter_0000003: the part of rank 1 taken from its copy "
                            "on another node") in printed, printed

    # Rank 0's part of 3 damaged, its copy lost with node 1: 2 (rank 1's part again from its copy).
    latest, printed = resumed("damaged", flips=["node0/iter_0000003/rank_00000/state.pt"])
    assert latest == 2, printed
    assert (f"local checkpoint {root}/node0/iter_0000003 is damaged (rank 0: state.pt differs from its checksum at "
            "save); skipped") in printed, printed

    latest, printed = resumed("repaired", [4], ["node0/iter_0000004/rank_00000/state.pt"], is_async=True)
    assert latest == 4 and "the part of rank 0 taken from its copy" in printed, printed

    assert resumed("restarted", [1])[0] == 1  # a run that saves 1 removes the newer parts a resume would take
    assert sorted(p.parent.parent.name for p in root.glob(f"node*/iter_*/rank_*/{CHECKSUMS}")) == ["iter_0000001"] * 4


def _killed_while_sending(rank, world, root):
    """Each rank a node of its own (as in :func:`_memory_tier_on_nodes`): save iteration 1, then 2 with the
    copies sent in 64-byte chunks and rank 0 SIGKILLed at its sixth send: a node lost in the middle of the
    copy its tier's thread sends."""
    import os
    import signal

    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    from megatron_zaya.checkpoint import peer_copy
    from megatron_zaya.checkpoint.local_tier import LocalTier
    from megatron_zaya.patches import apply_patches

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    apply_patches("cpu,checkpointing.local_tier")
    ps.initialize_model_parallel()
    group = ps.get_data_parallel_group(with_context_parallel=True)
    tier = LocalTier(f"{root}/node{rank}", 2, None, peer=True)
    for iteration in (1, 2):
        if iteration == 2:
            peer_copy.CHUNK_BYTES = 64
            if rank == 0:
                sends, isend = [], torch.distributed.isend

                def dying(*args, **kwargs):
                    sends.append(1)
                    if len(sends) == 6:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return isend(*args, **kwargs)

                torch.distributed.isend = dying
        state, _ = MCoreTensorAwareStateDict.from_state_dict(
            _sharded_state(iteration, rank, world), algo="fully_parallel", parallelization_group=group)
        tier.save(state, iteration, is_async=False)
        tier.finish()


def test_a_copy_cut_short_by_a_lost_node_is_never_taken(tmp_path):
    """Node 0 SIGKILLed while its tier's thread sends its part of 2 to node 1: node 1 holds a copy cut short,
    which has no checksum record. Node 0 replaced, the resume takes 1 (rank 0's part from its complete copy)."""
    import torch.multiprocessing as mp

    root = tmp_path / "mem"
    with pytest.raises((mp.ProcessExitedException, mp.ProcessRaisedException)):
        run_ranks(_killed_while_sending, 2, tmp_path / "killed", str(root))
    cut = root / "node1" / "iter_0000002" / "rank_00000"
    assert any(cut.iterdir()) and not (cut / CHECKSUMS).exists()
    shutil.rmtree(root / "node0")
    results = run_ranks(_memory_tier_on_nodes, 2, tmp_path / "resumed", str(root), [], [], False)
    for rank, ((latest, loaded), printed) in enumerate(results):
        assert latest == 1 and loaded["sharded"] == [100.0 + 10 * rank + i for i in range(4)], (loaded, printed)
    assert f"local checkpoint {root}/node0/iter_0000002 is incomplete (no part from rank 0); skipped" \
        in results[0][1]  # (named after rank 0's directory, which prints)


def _bytes_read() -> int:
    """The bytes this process has read, from files, sockets or pipes (``rchar``)."""
    return int(Path("/proc/self/io").read_text().split("rchar:")[1].split()[0])


def _resume_then_save_until_killed(root, store, log, start):
    """In a forked process, one rank: resume from the tier (the loaded state must be exactly the one saved at
    that iteration; written to ``log`` with the bytes the resume read), then save iterations ``start``,
    ``start + 1``, ... of a 16 MiB state until killed, changing the state as soon as the copies allow, while the
    tier's thread writes; logging each save written."""
    import itertools
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    from megatron_zaya.checkpoint.local_tier import LocalTier
    from megatron_zaya.patches import apply_patches

    def state(iteration, fill=True):
        big = torch.full((1 << 22,), float(iteration)) if fill else torch.zeros(1 << 22)
        return {**_sharded_state(iteration, 0, 1, fill),
                "big": ShardedTensor.from_rank_offsets("big", big, (0, 0, 1))}

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    apply_patches("cpu,checkpointing.local_tier")
    ps.initialize_model_parallel()
    group = ps.get_data_parallel_group(with_context_parallel=True)
    with open(log, "a") as out:
        tier, before = LocalTier(root, 2, None), _bytes_read()
        latest = tier.find_latest()
        if latest >= 0:
            loaded = tier.load()[0].to_state_dict(state(latest, fill=False), algo="fully_parallel",
                                                  parallelization_group=group)
            read = _bytes_read() - before
            exact = all(torch.equal(loaded[k], v.data) for k, v in state(latest).items() if k != "iteration")
            out.write(f"resumed {latest} {'exact' if exact and loaded['iteration'] == latest else 'differs'} "
                      f"{read}\n")
            out.flush()
        os.fsync(out.fileno())
        tier = LocalTier(root, 2, None)
        for iteration in itertools.count(start):
            saved, _ = MCoreTensorAwareStateDict.from_state_dict(state(iteration), algo="fully_parallel",
                                                                 parallelization_group=group)
            tier.save(saved, iteration, is_async=False)  # returns once the save before it is written
            if iteration > start:
                out.write(f"saved {iteration - 1}\n")
                out.flush()
            _next_step(saved)


def test_sigkills_at_random_moments_of_a_write_leave_the_tier_resumable(tmp_path):
    """Four processes killed (SIGKILL) at random moments of their in-memory saves (copies, writes, pruning, in
    the tier's thread, while the process changes the state); each next one resumes from the newest part
    written, exactly, never older than the last save its predecessor reported, reading its 16 MiB once (the
    checksums taken as the data is read)."""
    import random
    import time

    import torch.multiprocessing as mp
    from gloo import FORKSERVER_PRELOAD

    context = mp.get_context("forkserver")
    context.set_forkserver_preload(FORKSERVER_PRELOAD + [__name__])
    root, log, chance = tmp_path / "mem", tmp_path / "log", random.Random(0)
    reported = []
    for launch in range(5):
        process = context.Process(target=_resume_then_save_until_killed,
                                  args=(str(root), str(tmp_path / f"store{launch}"), str(log), 1000 * (launch + 1)))
        process.start()
        if launch < 4:
            while not log.is_file() or f"saved {1000 * (launch + 1)}\n" not in log.read_text():
                assert process.is_alive(), log.read_text() if log.is_file() else "no log"
                time.sleep(0.005)
            time.sleep(chance.uniform(0.0, 0.3))
            process.kill()
            process.join()
            reported.append(max(int(line.split()[1]) for line in log.read_text().splitlines() if "saved" in line))
        else:
            while "resumed" not in log.read_text().splitlines()[-1]:
                time.sleep(0.005)
            process.kill()
    resumes = [line.split() for line in log.read_text().splitlines() if line.startswith("resumed")]
    assert [r[2] for r in resumes] == ["exact"] * 4, resumes
    assert all(16 << 20 < int(r[3]) < 20 << 20 for r in resumes), resumes  # read twice: over 32 MiB
    assert all(int(r[1]) >= saved for r, saved in zip(resumes, reported, strict=True)), (resumes, reported)
