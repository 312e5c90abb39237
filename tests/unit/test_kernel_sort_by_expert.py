"""The sort-by-expert Triton kernel (CPU interpreter) against its reference (ops/experts.py) and against Python's
stable ``sorted`` of (class, token): order, inverse, counts and sorted gates equal exactly, whatever the blocks."""

import pytest
import torch

from triton_interpreter import load_kernel_module

from megatron_zaya.ops import experts as ops

kernels = load_kernel_module("megatron_zaya.kernels.sort_by_expert")


def _routing_map(tokens: int, classes: int, skipped: float, gen: torch.Generator, only: int | None = None):
    """A top-1 map [tokens, classes]: each token's one chosen class, or none for a share ``skipped`` of them."""
    chosen = torch.randint(0, classes, (tokens,), generator=gen) if only is None else torch.full((tokens,), only)
    routing_map = torch.nn.functional.one_hot(chosen, classes).bool()
    routing_map[torch.rand(tokens, generator=gen) < skipped] = False
    return routing_map


def _python_sort(routing_map: torch.Tensor, first: int, num_experts: int):
    rows = routing_map[:, first: first + num_experts].tolist()
    cls = [row.index(True) if True in row else num_experts for row in rows]
    order = sorted(range(len(cls)), key=lambda t: (cls[t], t))
    inverse = [0] * len(order)
    for position, token in enumerate(order):
        inverse[token] = position
    counts = [sum(1 for c in cls if c == e) for e in range(num_experts)]
    return [torch.tensor(x, dtype=torch.int64) for x in (order, inverse, counts)]


def _assert_sorts_as_the_reference(routing_map: torch.Tensor, first: int, num_experts: int, gen: torch.Generator):
    """The kernel's order, inverse and counts equal the reference's, without and with the gates (nonzero in every
    column, the chosen one's and the others'), whose sorted values are each token's chosen gate."""
    expected = ops.sort_by_expert(routing_map, first, num_experts)
    got = kernels.sort_by_expert(routing_map, first, num_experts)
    for name, g, e in zip(("order", "inverse", "counts"), got, expected):
        assert g.dtype == torch.int64 and torch.equal(g, e), (name, g, e)
    gates = torch.rand(routing_map.shape, generator=gen) + 0.5
    *got, sorted_gates = kernels.sort_by_expert(routing_map, first, num_experts, gates)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    chosen = (gates * routing_map)[:, first:first + num_experts].sum(-1)
    assert torch.equal(sorted_gates, chosen[expected[0]]), (sorted_gates, chosen[expected[0]])


# The interpreter's tuning (blocks of 8 tokens, counted in steps of 32) gives the larger maps several programs, two
# count steps and a partial last block; the next test varies both sizes.
@pytest.mark.parametrize("tokens,classes,first,num_experts,skipped,only", [
    (53, 17, 0, 16, 0.2, None),  # ZAYA1: 16 experts + the skip class; 7 blocks, a partial last one
    (40, 17, 4, 4, 0.1, None),  # an EP rank's 4 experts of 16: the other ranks' tokens last
    (16, 9, 0, 8, 0.0, 3),  # every token to one expert, none to the others
    (21, 5, 0, 4, 1.0, None),  # every token skipped
    (1, 3, 0, 2, 0.0, None),
    (0, 5, 0, 4, 0.0, None),  # no tokens: zero counts
])
def test_the_kernel_sorts_as_the_reference_and_as_python(tokens, classes, first, num_experts, skipped, only):
    gen = torch.Generator().manual_seed(tokens * classes)
    routing_map = _routing_map(tokens, classes, skipped, gen, only)
    expected = _python_sort(routing_map, first, num_experts)
    got = ops.sort_by_expert(routing_map, first, num_experts)
    assert all(torch.equal(g, e) for g, e in zip(got, expected)), (got, expected)
    _assert_sorts_as_the_reference(routing_map, first, num_experts, gen)


@pytest.mark.parametrize("block,count_block", [
    (4, 4),  # 12 programs, 12 count steps, a last block of one token
    (16, 8),  # count steps smaller than the blocks
    (32, 64),  # one count step past the end
    (64, 16),  # one program
])
def test_any_blocks_and_count_steps_give_the_same_sort(block, count_block, monkeypatch):
    """Each program's offsets (the classes' starts and their tokens in earlier blocks) whatever the blocks."""
    monkeypatch.setitem(kernels.SORT_TUNING, "cpu", {"block": block, "count_block": count_block, "warps": 4})
    gen = torch.Generator().manual_seed(block * count_block)
    routing_map = _routing_map(45, 17, 0.2, gen)
    routing_map[:, 2 + 5] = False  # expert 5 of the 12 from column 2 gets no tokens
    _assert_sorts_as_the_reference(routing_map, 2, 12, gen)
    assert ops.sort_by_expert(routing_map, 2, 12)[2][5] == 0


def test_a_strided_map_is_read_in_place():
    """The map of an all-gathered EP group may be a view: the kernel reads it through its strides."""
    gen = torch.Generator().manual_seed(0)
    wide = _routing_map(37, 34, 0.2, gen).view(37, 2, 17)[:, 1]  # [37, 17], row stride 34
    assert not wide.is_contiguous()
    expected = ops.sort_by_expert(wide.contiguous(), 0, 16)
    for g, e in zip(kernels.sort_by_expert(wide, 0, 16), expected):
        assert torch.equal(g, e)


def test_a_map_that_is_not_a_bool_top1_map_is_refused():
    with pytest.raises(ValueError, match="bool routing map"):
        kernels.sort_by_expert(torch.zeros(4, 3), 0, 2)
    with pytest.raises(ValueError, match="are not columns"):
        kernels.sort_by_expert(torch.zeros(4, 3, dtype=torch.bool), 2, 2)
