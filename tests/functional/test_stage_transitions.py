"""ZAYA1's 4k -> 32k -> 128k schedule in miniature, on CPU with gloo and the ``test`` preset: each stage loads the
previous one's checkpoint with a longer sequence, a new layout and (once) a new RoPE base, with its optimizer state.

1. sequence 64, DP2, ZeRO-1 Muon, routers frozen for the first 2 steps' tokens (their weights bit for bit as at
   step 1 until they thaw at step 3, on every rank's shard, while their momentum fills), expert clipping;
2. sequence 256, CP2, packed documents, selective recomputation, RoPE θ 1e6 (named by
   ``--zaya-allow-rotary-base-change``; without it the same command stops in one line, exit 2);
3. sequence 512, CP4 × EP2.

Each stage's first loss is finite and close to the last one before it, and the optimizer's step count runs on
through the stages (its state is loaded, not restarted).
"""

from __future__ import annotations

import math
import re

from test_recipe_cli import _assert_frozen_until, _states
from zaya_cli import checkpoint_state, losses, pretrain

COMMON = ["--zaya-preset", "test", "--mock-data", "--eval-iters", "0", "--log-interval", "1", "--lr", "1e-3",
          "--lr-decay-style", "constant", "--lr-warmup-iters", "0", "--optimizer", "zaya_muon",
          "--use-distributed-optimizer"]  # fmt: skip
STAGE_2 = ["--seq-length", "256", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "4",
           "--context-parallel-size", "2", "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss",
           "--recompute-granularity", "selective", "--rotary-base", "1000000", "--override-opt_param-scheduler"]
STAGE_3 = ["--seq-length", "512", "--max-position-embeddings", "512", "--micro-batch-size", "1", "--global-batch-size",
           "1", "--train-iters", "5", "--context-parallel-size", "4", "--expert-model-parallel-size", "2",
           "--recompute-granularity", "selective", "--rotary-base", "1000000", "--override-opt_param-scheduler"]


def _run(flags, cwd, nproc):
    run = pretrain(COMMON + flags, cwd=cwd, nproc=nproc)
    assert run.returncode == 0, run.stderr[-3000:]
    return run, losses(run.stdout)


def test_a_run_moves_from_4k_to_32k_to_128k_layouts(tmp_path):
    s1, s2, s3 = (str(tmp_path / f"stage{i}") for i in (1, 2, 3))
    stage1 = ["--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
              "--save-interval", "1", "--zaya-router-freeze-tokens", str(4 * 64 + 1),
              "--zaya-expert-clip-grad", "0.05"]  # fmt: skip
    run1, first = _run(stage1 + ["--save", s1], tmp_path, nproc=2)
    assert re.findall(r"routers thaw at iteration (\d+)", run1.stdout) == ["3"], run1.stdout[-3000:]
    _assert_frozen_until(_states(tmp_path / "stage1", range(1, 4), tmp_path), thaw=3, named_moments=True)

    refused = pretrain(COMMON + ["--seq-length", "256", "--micro-batch-size", "1", "--global-batch-size", "1",
                                 "--train-iters", "4", "--rotary-base", "1000000", "--load", s1, "--save", "",
                                 "--save-interval", "10"],
                       cwd=tmp_path)  # fmt: skip
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.strip().splitlines()[-1].endswith(
        "it was trained with another RoPE base (--rotary-base 10000 in the checkpoint, 1e+06 here); add "
        "--zaya-allow-rotary-base-change if the new base is meant (a context extension), or give the checkpoint's")

    run2, second = _run(STAGE_2 + ["--zaya-allow-rotary-base-change", "--load", s1, "--save", s2, "--save-interval",
                                   "10"], tmp_path, nproc=2)  # fmt: skip
    assert "--rotary-base changes from 10000 to 1e+06" in run2.stdout
    _, third = _run(STAGE_3 + ["--load", s2, "--save", s3, "--save-interval", "10"], tmp_path, nproc=4)
    assert sorted(first) == [1, 2, 3] and sorted(second) == [4] and sorted(third) == [5]
    for before, after in ((first[3], second[4]), (second[4], third[5])):
        assert math.isfinite(after) and abs(after - before) < 0.5, (before, after)
    state = checkpoint_state(tmp_path / "stage3" / "iter_0000005", tmp_path)
    steps = [v for k, v in state.items() if re.search(r"optimizer.*param_groups/\d+/step$", k)]
    assert steps and all(step == 5 for step in steps), steps  # 3 + 1 + 1: AdamW's state came through both loads
