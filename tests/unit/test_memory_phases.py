"""``benchmarks/memory_phases.py``'s report of an allocator snapshot: segments summed by the code that asked for them
and by pool (the general cache by stream, each private pool apart), released segments apart."""

from __future__ import annotations

import torch

from benchmarks import memory_phases

GIB = 2**30


def _frame(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


def test_segments_are_summed_by_who_asked_and_by_pool(monkeypatch, capsys):
    head = [_frame("/x/site-packages/torch/cuda/memory.py", 1, "malloc"),
            _frame("/repo/megatron_zaya/kernels/cross_entropy.py", 244, "_forward_with_grads"),
            _frame("/repo/megatron_zaya/ops/lm_head.py", 63, "fused_linear_cross_entropy")]
    trace = [
        {"action": "segment_alloc", "size": 2 * GIB, "stream": 0, "frames": head},
        {"action": "segment_alloc", "size": GIB, "stream": 0, "frames": head},
        {"action": "segment_map", "size": GIB // 2, "stream": 0, "frames": []},
        {"action": "alloc", "size": 5 * GIB, "stream": 0, "frames": head},  # a block, not a segment
        {"action": "segment_free", "size": GIB, "stream": 0, "frames": []},
    ]
    segments = [{"stream": 0, "total_size": 3 * GIB, "segment_pool_id": (0, 0)},
                {"stream": 7, "total_size": GIB, "segment_pool_id": (0, 0)},
                {"stream": 7, "total_size": 2 * GIB, "segment_pool_id": (1, 3)},
                {"stream": 7, "total_size": GIB, "segment_pool_id": (2, 0)}]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    memory_phases.segments_report({"segments": segments, "device_traces": [trace]}, top=5)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("[segments] reserved now: stream 0 3.00 GiB, stream 7 1.00 GiB, private pool 1.3 2.00 GiB, "
                        "private pool 2.0 1.00 GiB")
    assert lines[1] == "[segments] reserved in the step: 3 segments, 3.50 GiB; released: 1, 1.00 GiB"
    assert lines[2] == ("[segments]    3.00 GiB  kernels/cross_entropy.py:244 _forward_with_grads < "
                        "ops/lm_head.py:63 fused_linear_cross_entropy")
    assert lines[3] == "[segments]    0.50 GiB  (no Python frame: autograd's engine or a C++ op)"
