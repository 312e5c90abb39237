"""Expert parallel 8 on eight gloo ranks equals one rank.

16 experts, 2 per rank; with world 8 the dense part is data parallel 8, one sequence per rank. The step and
its checks are ``test_zaya_parallel``'s: per-token losses and every gradient after Megatron's DDP reduction
against the one-rank run (allgather dispatcher), each expert's gradient found on the rank that holds it, and
the balancing step's all-reduced counts and biases bit for bit on every rank.
"""

from __future__ import annotations

import torch
import test_zaya_parallel as parallel
from gloo import run_ranks
from test_zaya_parallel import Layout, assert_equal_to_reference, train_step_worker

WORLD, SEQ = 8, 16
# One sequence per data-parallel rank (the shared module's batch of 4 cannot be split eight ways).
TOKENS = torch.randint(0, 512, (WORLD, SEQ + 1), generator=torch.Generator().manual_seed(8))
SIXTEEN_EXPERTS = (("num_moe_experts", 16),)


def eight_sequence_worker(rank: int, world: int, layout: Layout, full_state: dict | None) -> dict:
    parallel.TOKENS = TOKENS  # train_step_worker reads the module's global batch
    return train_step_worker(rank, world, layout, full_state)


def test_expert_parallel_8_equals_one_rank(tmp_path):
    (reference,) = run_ranks(eight_sequence_worker, 1, tmp_path / "reference",
                             Layout(dispatcher="allgather", model=SIXTEEN_EXPERTS), None)  # fmt: skip
    counts = torch.stack(reference["reduced_counts"])  # [layers, experts + skip]
    assert (counts[:, :-1] > 0).sum() >= 24, counts  # most experts get tokens: the dispatch is exercised
    results = run_ranks(eight_sequence_worker, WORLD, tmp_path / "ep8", Layout(ep=8, etp=1, model=SIXTEEN_EXPERTS),
                        reference["state"])  # fmt: skip
    assert [r["dp"] for r in results] == [(rank, WORLD) for rank in range(WORLD)]
    assert_equal_to_reference(results, reference)
