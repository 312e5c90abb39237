"""Grouped expert GEMM Triton kernels (CPU interpreter) against float64 torch.

The interpreter cannot multiply bfloat16 (see tests/triton_interpreter.py), so fp32 and fp16 here;
bf16 runs in tests/gpu/test_kernels_gpu.py. The interpreter's launch settings (``GEMM_TUNING["cpu"]``) are 16-wide
tiles: several tiles per expert, ragged edges, several contraction steps.
"""

import pytest
import torch

from triton_interpreter import assert_matches_oracle, assert_weight_grads_match, load_kernel_module

from megatron_zaya.ops import experts as ops

kernels = load_kernel_module("megatron_zaya.kernels.grouped_gemm")


def _run(fn, x, weight, counts, grad, dtype=None, **kwargs):
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (x, weight)]
    out = fn(*leaves, counts, **kwargs)
    return [out, *torch.autograd.grad(out, leaves, grad.to(out.dtype))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_gemm_forward_backward(dtype):
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 23, 9])  # an expert with no tokens, one spanning two row tiles
    rows, k_dim, m_dim = int(counts.sum()), 40, 24
    x = torch.randn(rows, k_dim, generator=gen).to(dtype)
    weight = (0.2 * torch.randn(len(counts), m_dim, k_dim, generator=gen)).to(dtype)
    grad = torch.randn(rows, m_dim, generator=gen)

    kernel = _run(kernels.grouped_gemm, x, weight, counts, grad)
    reference = _run(ops.grouped_gemm, x, weight, counts, grad)
    oracle = _run(ops.grouped_gemm, x, weight, counts, grad, torch.float64)
    assert kernel[0].dtype == kernel[1].dtype == kernel[2].dtype == dtype
    assert (kernel[2][1] == 0).all()  # the idle expert gets a zero gradient
    for name, k, r, o in zip(["out", "d_x", "d_weight"], kernel, reference, oracle):
        assert_matches_oracle(name, k, o, r)


def test_padded_rows_are_left_out_with_zero_outputs_and_gradients():
    """A static-size buffer: 11 rows after the experts' 37 belong to no expert (tokens of the skip class)."""
    gen = torch.Generator().manual_seed(1)
    counts = torch.tensor([5, 0, 23, 9])
    rows, k_dim, m_dim = int(counts.sum()) + 11, 40, 24
    x = torch.randn(rows, k_dim, generator=gen)
    weight = 0.2 * torch.randn(len(counts), m_dim, k_dim, generator=gen)
    grad = torch.randn(rows, m_dim, generator=gen)

    kernel = _run(kernels.grouped_gemm, x, weight, counts, grad, padded_rows=True)
    oracle = _run(ops.grouped_gemm, x[:37], weight, counts, grad[:37], torch.float64)
    assert (kernel[0][37:] == 0).all() and (kernel[1][37:] == 0).all()
    for name, k, o in zip(["out", "d_x", "d_weight"], kernel, oracle):
        assert_matches_oracle(name, k[:37] if name != "d_weight" else k, o)
    with pytest.raises(ValueError, match="sums to 37, but x has 48 rows"):
        kernels.grouped_gemm(x, weight, counts)


def test_row_tiles_never_straddle_experts():
    counts = torch.tensor([5, 0, 23, 9])
    expert, first_row, row_end, row_start = kernels._row_tiles(counts, int(counts.sum()), False, block_m=16)
    used = expert >= 0
    assert expert[used].tolist() == [0, 2, 2, 3] and first_row[used].tolist() == [0, 5, 21, 28]
    assert row_end[used].tolist() == [5, 28, 28, 37] and row_start.tolist() == [0, 5, 5, 28]


def test_bad_inputs_raise_clear_errors():
    x, weight = torch.randn(6, 8), torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="sums to 5"):
        kernels.grouped_gemm(x, weight, torch.tensor([2, 3]))
    with pytest.raises(ValueError, match=r"weight \[E, M, K\]"):
        kernels.grouped_gemm(x, torch.randn(2, 4, 7), torch.tensor([3, 3]))


@pytest.mark.parametrize("padded_rows", [False, True])
def test_separate_expert_weights_are_read_in_place(padded_rows):
    """E separate [M, K] weights (the experts' parameters, read through their addresses): same outputs as the
    stacked weight, and one gradient per expert."""
    gen = torch.Generator().manual_seed(2)
    counts = torch.tensor([5, 0, 23, 9])
    rows, k_dim, m_dim = int(counts.sum()) + (11 if padded_rows else 0), 40, 24
    x = torch.randn(rows, k_dim, generator=gen, requires_grad=True)
    weights = [(0.2 * torch.randn(m_dim, k_dim, generator=gen)).requires_grad_() for _ in counts]
    grad = torch.randn(rows, m_dim, generator=gen)

    assert kernels._offset_table(weights, x.device) is not None  # read in place, not stacked
    out = kernels.grouped_gemm(x, weights, counts, padded_rows=padded_rows)
    got = [out, *torch.autograd.grad(out, [x, *weights], grad)]
    stacked = torch.stack([w.detach() for w in weights])
    oracle = _run(ops.grouped_gemm, x, stacked, counts, grad, torch.float64, padded_rows=padded_rows)
    assert_matches_oracle("out", got[0], oracle[0])
    assert_matches_oracle("d_x", got[1], oracle[1])
    for e, grad_e in enumerate(got[2:]):
        assert grad_e.shape == (m_dim, k_dim)
        assert_matches_oracle(f"d_weight[{e}]", grad_e, oracle[2][e])


def test_gemms_sharing_one_counts_tensor_each_get_their_own_rows():
    """An MoE layer's GEMMs share one counts tensor and its row-tile table; a GEMM on the same counts over a
    buffer with a different tail (or none) must still get the table of its own rows."""
    gen = torch.Generator().manual_seed(3)
    counts = torch.tensor([5, 0, 23, 9])
    weight = 0.2 * torch.randn(len(counts), 24, 40, generator=gen)
    for tail, padded_rows in [(11, True), (0, False), (40, True), (11, True)]:
        x = torch.randn(37 + tail, 40, generator=gen)
        grad = torch.randn(37 + tail, 24, generator=gen)
        got = _run(kernels.grouped_gemm, x, weight, counts, grad, padded_rows=padded_rows)
        oracle = _run(ops.grouped_gemm, x, weight, counts, grad, torch.float64, padded_rows=padded_rows)
        for name, g, o in zip(["out", "d_x", "d_weight"], got, oracle):
            assert_matches_oracle(f"{name} (tail {tail})", g, o)


@pytest.mark.parametrize("enabled, gap", [(True, 3), (True, 16), (False, 3)],
                         ids=["uneven-offsets", "aligned-offsets", "off"])
def test_weight_gradients_accumulate_into_megatron_main_grad(enabled, gap, monkeypatch):
    """Experts under Megatron's DDP (a ``main_grad`` per weight, views into one fp32 buffer, at offsets that are
    or are not multiples of 16 elements): the kernel adds each expert's gradient to what ``main_grad`` holds and
    tells Megatron's hooks so; switched off, ``main_grad`` is untouched and the gradients come back as tensors."""
    monkeypatch.setitem(kernels.ACCUMULATE_INTO_MAIN_GRAD, "enabled", enabled)
    gen = torch.Generator().manual_seed(3)
    counts = torch.tensor([5, 0, 23, 9])
    rows, k_dim, m_dim = int(counts.sum()), 40, 24
    x = torch.randn(rows, k_dim, generator=gen, requires_grad=True)
    weights = [(0.2 * torch.randn(m_dim, k_dim, generator=gen)).requires_grad_() for _ in counts]
    buffer = torch.randn(len(counts) * (m_dim * k_dim + gap), generator=gen)  # gaps between the experts
    for e, weight in enumerate(weights):
        start = e * (m_dim * k_dim + gap)
        weight.main_grad = buffer[start : start + m_dim * k_dim].view(m_dim, k_dim)
        weight.grad_added_to_main_grad = False
    before = [w.main_grad.clone() for w in weights]
    grad = torch.randn(rows, m_dim, generator=gen)

    if enabled:
        assert kernels._main_grads(weights)[2] == (gap % 16 == 0)
    out = kernels.grouped_gemm(x, weights, counts)
    got = torch.autograd.grad(out, weights, grad)
    stacked = torch.stack([w.detach() for w in weights])
    oracle = _run(ops.grouped_gemm, x, stacked, counts, grad, torch.float64)[2]
    assert_weight_grads_match(weights, before, got, oracle, enabled)


@pytest.mark.parametrize("padded_rows", [False, True])
def test_row_tile_table_enumerates_each_experts_rows_then_spare_tiles(padded_rows):
    """The row-tile kernel against the table written out by hand: each expert's rows in tiles of 16, in expert
    order (none for an expert without tokens), then spare tiles (-1) from the end of the routed rows on."""
    counts, block_m, n_rows = torch.tensor([5, 0, 40, 16, 1]), 16, 90  # 62 routed rows, 28 in the tail
    expected, row = [], 0
    for expert, count in enumerate(counts.tolist()):
        expected += [(expert, row + first, row + count) for first in range(0, count, block_m)]
        row += count
    n_tiles = -(-n_rows // block_m) + len(counts) + (-(-n_rows // block_m) if padded_rows else 0)
    expected += [(-1, row + i * block_m, n_rows) for i in range(n_tiles - len(expected))]
    expert, first_row, row_end, row_start = kernels._row_tiles(counts, n_rows, padded_rows, block_m)
    assert list(zip(expert.tolist(), first_row.tolist(), row_end.tolist())) == expected
    assert row_start.tolist() == [0, 5, 5, 45, 61]


@pytest.mark.parametrize("padded_rows", [False, True])
@pytest.mark.parametrize("layout", ["stacked", "separate"])
def test_rows_in_token_order_are_gathered_and_scattered_through_the_sort(layout, padded_rows):
    """The ``moe`` op's GEMMs: rows in token order around rows sorted by expert (``order``: sorted row i is token
    order[i]; with ``padded_rows`` 11 tokens of no expert sorted last). The row-tile kernel reading its rows through
    the order or writing them through it gives the bits it gives on permuted copies (the same tiles), and float64
    torch's results with the rows permuted explicitly; the scattered rows of no expert are zero."""
    gen = torch.Generator().manual_seed(4)
    counts = torch.tensor([5, 0, 23, 9])
    rows, k_dim, m_dim = 37 + (11 if padded_rows else 0), 40, 24
    order = torch.randperm(rows, generator=gen)
    inverse = order.argsort()
    x, grad = torch.randn(rows, k_dim, generator=gen), torch.randn(rows, m_dim, generator=gen)  # in token order
    stacked = 0.2 * torch.randn(len(counts), m_dim, k_dim, generator=gen)
    weight = stacked if layout == "stacked" else [w.clone() for w in stacked]
    _, counts, _, table, *weights = kernels.prepare(x, weight, counts, padded_rows)
    assert (table is None) == (layout == "stacked")  # the separate weights read in place, through their offsets

    def matmul(a, transposed, **tables):
        return kernels.matmul(a, counts, padded_rows, table, weights, transposed, **tables)

    out, grad_x = matmul(x[order], True), matmul(grad[order], False)  # sorted by expert
    grad_w = kernels.weight_grad(grad[order], x[order], counts, padded_rows, weights, None)
    out_tokens, grad_x_tokens = matmul(x[order], True, scatter=order), matmul(grad[order], False, scatter=order)
    assert torch.equal(out_tokens, out[inverse]) and torch.equal(grad_x_tokens, grad_x[inverse])
    assert (out_tokens[order[37:]] == 0).all() and (grad_x_tokens[order[37:]] == 0).all()
    assert torch.equal(matmul(x, True, gather=order), out)
    assert torch.equal(matmul(x, True, gather=order, scatter=order), out_tokens)
    assert torch.equal(matmul(grad, False, gather=order), grad_x)
    oracle = _run(ops.grouped_gemm, x[order], stacked, counts, grad[order], torch.float64, padded_rows=padded_rows)
    assert_matches_oracle("out", out_tokens, oracle[0][inverse])
    assert_matches_oracle("d_x", grad_x_tokens, oracle[1][inverse])
    assert_matches_oracle("d_weight", grad_w, oracle[2])
