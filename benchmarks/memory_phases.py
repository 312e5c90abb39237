"""Where a training run's reserved GPU memory comes from: ``python -m benchmarks.memory_phases -- ZAYA_PRETRAIN_FLAGS``.

Runs ``zaya-pretrain FLAGS`` in this process on one GPU (name it with ``CUDA_VISIBLE_DEVICES`` where there are more)
and prints torch's allocator figures (allocated, reserved,
their peaks, retries, segments) before and after the CUDA graphs' warm-up and capture and each training step. During
step ``--record-step`` (default 2, the first after the optimizer's state exists) it records the allocator's history
and prints the segments reserved then, summed by the code that asked for them (the innermost frames of Megatron,
megatron-zaya or torch.optim). A reserved peak well above the allocated one is memory that no request reuses; this
says which requests reserve it.

Example (one H100, a 16-layer proxy of ZAYA1-8B at micro-batch 4 with CUDA graphs)::

    python -m benchmarks.memory_phases -- --zaya-preset zaya1-8b --num-layers 16 --mock-data --seq-length 4096 \\
        --micro-batch-size 4 --global-batch-size 16 --bf16 --optimizer zaya_muon --use-distributed-optimizer \\
        --zaya-muon-momentum-dtype bf16 --grad-reduce-in-bf16 --recompute-granularity selective --zaya-cuda-graphs \\
        --train-iters 4 --lr 3e-4 --lr-warmup-iters 1 --eval-iters 0
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections import Counter

import torch

GIB = 2**30
OWN_CODE = ("megatron", "torch/optim")  # frames that name who asked; the allocator's own are left out


def allocator_line(when: str) -> str:
    stats = torch.cuda.memory_stats()
    return (f"[memory] {when}: allocated {torch.cuda.memory_allocated() / GIB:.2f}, reserved "
            f"{torch.cuda.memory_reserved() / GIB:.2f}, peak allocated {torch.cuda.max_memory_allocated() / GIB:.2f}, "
            f"peak reserved {torch.cuda.max_memory_reserved() / GIB:.2f} GiB; retries "
            f"{stats.get('num_alloc_retries', 0)}, segments {stats.get('segment.all.current', 0)}")


def around(owner, name: str, before: str | None, after: str | None) -> None:
    """Print the allocator's figures before and/or after each call of ``owner.name``."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        if before:
            torch.cuda.synchronize()
            print(allocator_line(before), flush=True)
        result = original(*args, **kwargs)
        if after:
            torch.cuda.synchronize()
            print(allocator_line(after), flush=True)
        return result

    setattr(owner, name, wrapped)


def asked_by(frames: list[dict], depth: int = 4) -> str:
    ours = [f"{f['filename'].rsplit('/', 2)[-2]}/{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
            for f in frames if any(part in f["filename"] for part in OWN_CODE)]
    return " < ".join(ours[:depth]) or "(no Python frame: autograd's engine or a C++ op)"


def segments_report(snapshot: dict, top: int) -> None:
    """The segments reserved during the recorded step, summed by who asked, and the reserved memory by pool: the
    general cache's by stream, and each private pool's (the CUDA graphs' pool, a ``torch.cuda.MemPool``)."""
    pools = Counter()
    for segment in snapshot["segments"]:
        pool = tuple(segment.get("segment_pool_id", (0, 0)))  # (0, 0): the general cache, by stream
        name = f"stream {segment['stream']}" if pool == (0, 0) else f"private pool {pool[0]}.{pool[1]}"
        pools[name] += segment["total_size"]
    print("[segments] reserved now: " + ", ".join(f"{name} {size / GIB:.2f} GiB" for name, size in pools.items()))
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    reserved = [e for e in trace if e["action"] in ("segment_alloc", "segment_map")]
    freed = [e for e in trace if e["action"] in ("segment_free", "segment_unmap")]
    by_asker = Counter()
    for event in reserved:
        by_asker[asked_by(event.get("frames", []))] += event["size"]
    print(f"[segments] reserved in the step: {len(reserved)} segments, {sum(by_asker.values()) / GIB:.2f} GiB; "
          f"released: {len(freed)}, {sum(e['size'] for e in freed) / GIB:.2f} GiB")
    for asker, size in by_asker.most_common(top):
        print(f"[segments] {size / GIB:7.2f} GiB  {asker}")


def recorded(train_step, step: int, top: int):
    """``train_step`` whose ``step``-th call runs with the allocator's history recorded, then reported."""
    calls = [0]

    @functools.wraps(train_step)
    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] != step:
            return train_step(*args, **kwargs)
        torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
        try:
            result = train_step(*args, **kwargs)
            torch.cuda.synchronize()
            segments_report(torch.cuda.memory._snapshot(), top)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        return result

    return wrapped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record-step", type=int, default=2, help="the training step whose segments are reported")
    parser.add_argument("--top", type=int, default=12, help="askers listed")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="zaya-pretrain flags (after --)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("memory_phases.py needs a CUDA or ROCm GPU")
    from megatron_zaya import pretrain

    flags = [f for f in args.flags if f != "--"]
    pretrain._before_megatron(flags)  # the patches due before Megatron is imported, as the command applies them
    import megatron.training.training as training

    from megatron_zaya.model.cuda_graphs import LayerGraphs

    around(LayerGraphs, "_capture", "before the graphs' warm-up", "after their capture")
    around(LayerGraphs, "_warm_up", None, "after a warm-up pass")
    training.train_step = recorded(training.train_step, args.record_step, args.top)
    around(training, "train_step", "before a step", "after it")
    return pretrain.main(flags)


if __name__ == "__main__":
    sys.exit(main())
