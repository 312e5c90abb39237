"""Grouped GEMM for top-1 MoE experts (Triton, forward and backward), for platforms without a fast one.

Tokens arrive sorted by expert (Megatron's permuted layout) with ``tokens_per_expert`` [E] counts; rows
[offset_e, offset_e + count_e) of x [N, K] are multiplied by expert e's weight [M, K]:

    out[rows of e] = x[rows of e] @ weight[e].T          x [N, K], weight [E, M, K] -> out [N, M]

One launch covers every expert: the grid enumerates row tiles expert by expert (tile -> expert map built on
the device from the counts, so there is no host sync), so a tile never straddles two experts and experts
with few tokens cost a partial tile, not a padded [capacity, K] block. The backward uses the same kernel for
d x = d out @ weight[e] and a second kernel for d weight[e] = d out[rows of e].T @ x[rows of e], which walks
the expert's rows. bf16/fp16 inputs use the tensor cores with fp32 accumulation; fp32 inputs use IEEE fp32.

With ``padded_rows`` the counts may cover fewer rows than x has: a static-size buffer whose tail (tokens routed
to no expert) is left out of every GEMM, so its output rows and gradients are zero (written by the grid's spare
tiles, not by a fill first). This is what lets the single-rank MoE dispatch (``model/moe.py``) run without
learning the routed count on the host.

The row-tile kernel may also read its input rows from, or write its output rows to, a tensor in another row order
(the tokens' own) through a row table, read once per tile (the spare tiles then zero the scattered rows of no
expert): a composite op (``ops/moe.py``) thus keeps no sorted copy of x or of the output around the expert GEMMs.
The weight-gradient kernel reads rows sorted by expert: a gather in its contraction loop would put a dependent
load before each step's data, which costs the sm_90 build half its pipeline stages.

The weights may also be E separate [M, K] tensors, such as the experts' own parameters: the kernel then finds
each expert's weight at its offset from the first one (a small device table), and no [E, M, K] copy is stacked
per call. The torch reference, the fallback and the choice live in ``ops/experts.py``; ``ops/grouped_mm.py`` may run
some GEMMs of a call by ``torch._grouped_mm`` and the others here (through :func:`prepare`, :func:`matmul` and
:func:`weight_grad`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary

from .launch import launch
from .utils import ACCUMULATE_INTO_MAIN_GRAD, GRADIENT_PLACEHOLDERS, cdiv, next_power_of_2, platform, triton_runs

#: Launch settings per platform (``utils.platform()``). The row-tile kernel (forward and input gradient): output
#: tile rows x columns, contraction step, warps, software-pipeline depth; the weight-gradient kernel: output tile
#: and tokens per contraction step, warps, depth. Tuned with ``benchmarks/tune_grouped_gemm.py``: CUDA's row tiles
#: on an H200; its weight gradient on an H100 as training runs it (``--main-grad``, added into each expert's
#: ``main_grad``, a read-modify-write that a wide tile with a deep contraction step amortises best); both kept when
#: retuned on an H100 after the programs were ordered for L2 reuse (``tune_grouped_gemm --batch 4 [--main-grad bf16]``).
GEMM_TUNING = {
    "cuda": {"block_m": 128, "block_n": 256, "block_k": 64, "warps": 8, "stages": 4,
             "wgrad_block_m": 128, "wgrad_block_n": 256, "wgrad_block_r": 64, "wgrad_warps": 8, "wgrad_stages": 3},
    "rocm": {"block_m": 128, "block_n": 128, "block_k": 64, "warps": 8, "stages": 2,  # 64 KB of LDS per CU
             "wgrad_block_m": 128, "wgrad_block_n": 128, "wgrad_block_r": 64, "wgrad_warps": 8, "wgrad_stages": 2},
    "cpu": {"block_m": 16, "block_n": 16, "block_k": 16, "warps": 4, "stages": 1,  # the interpreter: several tiles
            "wgrad_block_m": 16, "wgrad_block_n": 16, "wgrad_block_r": 16, "wgrad_warps": 4, "wgrad_stages": 1},
}  # fmt: skip


@triton.jit
def _grouped_matmul_kernel(
    a_ptr,  # [N, K_a] rows sorted by expert, or in another order read through a_rows
    b_ptr,  # per-expert [K_a, n_out] operand, addressed through strides
    b_table_ptr,  # with B_TABLE: [E] int64 offsets of each expert's operand from b_ptr, in elements
    c_ptr,  # [N, n_out]
    a_rows_ptr,  # with GATHER_A: [N] int64, row i is a's row a_rows[i]
    c_rows_ptr,  # with SCATTER_C: [N] int64 (a permutation), row i goes to c's row c_rows[i]
    tile_expert_ptr,  # [tiles] expert of each row tile, -1 for spare tiles
    tile_row_ptr,  # [tiles] first row of the tile
    tile_row_end_ptr,  # [tiles] end of the expert's rows (of the rows of no expert, for spare tiles)
    n_out,
    k_dim,
    stride_am,
    stride_be,
    stride_bk,
    stride_bn,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    B_TABLE: tl.constexpr,  # experts at b_ptr + b_table[e] instead of b_ptr + e * stride_be
    GATHER_A: tl.constexpr,
    SCATTER_C: tl.constexpr,
):
    # Column blocks vary fastest: the programs resident at once share a few row tiles and their expert's weight,
    # so each is read from memory about once rather than once per column block.
    n_blocks = tl.cdiv(n_out, BLOCK_N)
    tile, column_block = tl.program_id(0) // n_blocks, tl.program_id(0) % n_blocks
    expert = tl.load(tile_expert_ptr + tile)
    rows = tl.cast(tl.load(tile_row_ptr + tile) + tl.arange(0, BLOCK_M), tl.int64)
    row_mask = rows < tl.load(tile_row_end_ptr + tile)
    c_rows = rows  # or through a row table, read once per tile: no indirection inside the K loop
    if SCATTER_C:
        c_rows = tl.load(c_rows_ptr + rows, mask=row_mask, other=0)
    cols = column_block * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + c_rows[:, None] * stride_cm + cols[None, :]
    c_mask = row_mask[:, None] & (cols[None, :] < n_out)
    if expert < 0:  # a spare tile: zeros for the rows of no expert (scattered: the tokens of none), if any
        tl.store(c_ptrs, tl.zeros([BLOCK_M, BLOCK_N], dtype=c_ptr.dtype.element_ty), mask=c_mask)
        return
    a_rows = rows
    if GATHER_A:
        a_rows = tl.load(a_rows_ptr + rows, mask=row_mask, other=0)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :]
    if B_TABLE:  # each expert's offset from b_ptr, in elements (its weights need not be stacked)
        # a multiple of 16 elements (checked on the host): b_base keeps b_ptr's alignment, and with it the
        # wide vector loads the compiler cannot prove for a pointer read from memory
        b_base = b_ptr + tl.multiple_of(tl.load(b_table_ptr + expert), 16)
    else:
        b_base = b_ptr + tl.cast(expert, tl.int64) * stride_be
    b_ptrs = b_base + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        a = tl.load(a_ptrs, mask=row_mask[:, None] & (k0 + ks[None, :] < k_dim), other=0.0)
        b = tl.load(b_ptrs, mask=(k0 + ks[:, None] < k_dim) & (cols[None, :] < n_out), other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee")  # "ieee" only matters for fp32 inputs (no TF32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _grouped_weight_grad_kernel(
    grad_out_ptr,  # [N, M]
    x_ptr,  # [N, K]
    grad_w_ptr,  # [E, M, K], or expert 0's [M, K] gradient with W_TABLE
    grad_w_table_ptr,  # with W_TABLE: [E] int64 offsets of each expert's gradient from grad_w_ptr, in elements
    expert_row_start_ptr,  # [E]
    tokens_per_expert_ptr,  # [E]
    m_dim,
    k_dim,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rows (tokens) per contraction step
    W_TABLE: tl.constexpr,  # each expert's gradient at grad_w_ptr + grad_w_table[e] (the experts' own main_grads)
    W_ALIGNED: tl.constexpr,  # the table's offsets are multiples of 16 elements (checked on the host)
    ACCUMULATE: tl.constexpr,  # add to the gradient there instead of overwriting it
):
    # Expert by expert, its output tiles row by row: the programs resident at once share one expert's rows of
    # grad_out and x, which are read from memory about once rather than once per output column block.
    m_blocks, k_blocks = tl.cdiv(m_dim, BLOCK_M), tl.cdiv(k_dim, BLOCK_N)
    expert = tl.program_id(0) // (m_blocks * k_blocks)
    ms = tl.program_id(0) // k_blocks % m_blocks * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.program_id(0) % k_blocks * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    start = tl.load(expert_row_start_ptr + expert)
    end = start + tl.load(tokens_per_expert_ptr + expert)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = tl.cast(r0 + rs, tl.int64)
        row_mask = r0 + rs < end
        grad_t = tl.load(grad_out_ptr + rows[None, :] * m_dim + ms[:, None],
                         mask=row_mask[None, :] & (ms[:, None] < m_dim), other=0.0)  # fmt: skip
        x = tl.load(x_ptr + rows[:, None] * k_dim + ks[None, :],
                    mask=row_mask[:, None] & (ks[None, :] < k_dim), other=0.0)  # fmt: skip
        acc = tl.dot(grad_t, x, acc, input_precision="ieee")
    if W_TABLE:
        offset = tl.load(grad_w_table_ptr + expert)
        if W_ALIGNED:  # as for the forward's weights: wide vector loads and stores of the fp32 main_grad
            offset = tl.multiple_of(offset, 16)
        w_base = grad_w_ptr + offset
    else:
        w_base = grad_w_ptr + tl.cast(expert, tl.int64) * m_dim * k_dim
    w_ptrs = w_base + ms[:, None] * k_dim + ks[None, :]
    w_mask = (ms[:, None] < m_dim) & (ks[None, :] < k_dim)
    if ACCUMULATE:
        acc += tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float32)
    tl.store(w_ptrs, acc.to(grad_w_ptr.dtype.element_ty), mask=w_mask)


@triton.jit
def _row_tiles_kernel(counts_ptr, expert_ptr, first_row_ptr, row_end_ptr, row_start_ptr, n_experts, n_rows,
                      n_tiles, BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr, BLOCK: tl.constexpr):
    """The row-tile table of :func:`_row_tiles`, one program: tiles enumerated expert by expert, then spare ones."""
    e = tl.arange(0, EXPERTS)
    real = e < n_experts
    counts = tl.load(counts_ptr + e, mask=real, other=0).to(tl.int64)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, 0)
    tile_start = tile_end - tiles
    row_start = tl.cumsum(counts, 0) - counts
    tl.store(row_start_ptr + e, row_start, mask=real)
    routed_rows, routed_tiles = tl.sum(counts, 0), tl.sum(tiles, 0)
    for start in range(0, n_tiles, BLOCK):
        tile = start + tl.arange(0, BLOCK).to(tl.int64)
        expert = tl.sum(((tile_end[None, :] <= tile[:, None]) & real[None, :]).to(tl.int32), 1)  # searchsorted
        routed = expert < n_experts
        own = e[None, :] == expert[:, None]  # [BLOCK, EXPERTS]: the tile's expert, none for spare tiles
        rows_before = tl.sum(tl.where(own, row_start[None, :], 0), 1)
        tiles_before = tl.sum(tl.where(own, tile_start[None, :], 0), 1)
        rows_of_expert = tl.sum(tl.where(own, counts[None, :], 0), 1)
        first_row = tl.where(routed, rows_before + (tile - tiles_before) * BLOCK_M,
                             routed_rows + (tile - routed_tiles) * BLOCK_M)  # spare: past the experts' rows
        in_range = tile < n_tiles
        tl.store(expert_ptr + tile, tl.where(routed, expert, -1).to(tl.int64), mask=in_range)
        tl.store(first_row_ptr + tile, first_row, mask=in_range)
        tl.store(row_end_ptr + tile, tl.where(routed, rows_before + rows_of_expert, n_rows), mask=in_range)


def _row_tiles(tokens_per_expert: torch.Tensor, n_rows: int, padded_rows: bool, block_m: int):
    """Per row tile of ``block_m`` rows: its expert (-1: spare), first row, end of its expert's rows; and each
    expert's first row. One launch, no host sync.

    With ``padded_rows`` the spare tiles cover the rows after the experts' (they write zeros there), so the
    output needs no zero fill first.
    """
    n_experts, device = tokens_per_expert.numel(), tokens_per_expert.device
    spare = cdiv(n_rows, block_m) if padded_rows else 0  # enough for any tail
    n_tiles = cdiv(n_rows, block_m) + n_experts + spare
    expert, first_row, row_end = (torch.empty(n_tiles, dtype=torch.int64, device=device) for _ in range(3))
    row_start = torch.empty(n_experts, dtype=torch.int64, device=device)
    launch(_row_tiles_kernel, (1,), tokens_per_expert, expert, first_row, row_end, row_start, n_experts, n_rows,
           n_tiles, BLOCK_M=block_m, EXPERTS=next_power_of_2(n_experts), BLOCK=128, num_warps=4)
    return expert, first_row, row_end, row_start


_TILES = WeakIdKeyDictionary()  # counts tensor -> {(rows, padded_rows, block_m): its row tiles}


def _shared_row_tiles(tokens_per_expert: torch.Tensor, n_rows: int, padded_rows: bool, block_m: int):
    """:func:`_row_tiles`, built once per counts tensor: an MoE layer's two expert GEMMs (and their backward)
    take the same counts. The counts are never changed in place (each
    forward makes new ones), so a table stays right for as long as its counts tensor lives."""
    tables = _TILES.setdefault(tokens_per_expert, {})
    key = (n_rows, padded_rows, block_m)
    if key not in tables:
        tables[key] = _row_tiles(tokens_per_expert, n_rows, padded_rows, block_m)
    return tables[key]


def _offset_table(tensors, device, align: int = 16) -> torch.Tensor | None:
    """Each tensor's offset from the first one, in elements, as an int64 device tensor; None unless every offset
    is a multiple of ``align`` elements (the kernel's alignment hint for weights). Built once per set of addresses
    and kept: a CUDA graph captured with it reads it at every replay, and a capture must not copy from the host
    (the layers' eager warm-up builds it first)."""
    base, size = tensors[0].data_ptr(), tensors[0].element_size()
    offsets = tuple(t.data_ptr() - base for t in tensors)
    if any(offset % (align * size) for offset in offsets):
        return None
    key = (device, base, offsets, size)
    if key not in _OFFSET_TABLES:
        _OFFSET_TABLES[key] = torch.tensor([o // size for o in offsets], dtype=torch.int64, device=device)
    return _OFFSET_TABLES[key]


_OFFSET_TABLES: dict[tuple, torch.Tensor] = {}


class _Operand:
    """The experts' [M, K] weights for the kernel: one stacked [E, M, K] tensor, or E tensors found through an
    offset table (``table``)."""

    def __init__(self, weights, table: torch.Tensor | None):
        self.stacked = table is None
        self.base, self.table = weights[0], table
        self.stride_e = weights[0].stride(0) if self.stacked else 0
        self.m_dim, self.k_dim = weights[0].shape[-2:]

    def strides(self, transposed: bool):
        """(stride_e, stride_k, stride_n) of B_e = weight[e].T (transposed) or weight[e], contiguous rows."""
        return (self.stride_e, 1, self.k_dim) if transposed else (self.stride_e, self.k_dim, 1)


def _grouped_matmul(a, operand: _Operand, transposed: bool, n_out, tiles, tuning: dict, gather, scatter):
    """For each expert e: c[rows of e] = a[rows of e] @ B_e, B_e = weight[e].T or weight[e]; rows of no
    expert (spare tiles, ``padded_rows``) are zero. Row i read from a[gather[i]], written to c[scatter[i]]."""
    tile_expert, tile_row, tile_row_end, _ = tiles
    c = torch.empty((a.shape[0], n_out), dtype=a.dtype, device=a.device)
    grid = (tile_expert.numel() * cdiv(n_out, tuning["block_n"]),)
    launch(_grouped_matmul_kernel, grid,
        a, operand.base, operand.base if operand.table is None else operand.table,  # (table unread when stacked)
        c, *_row_tables(tile_row, gather, scatter), tile_expert, tile_row, tile_row_end, n_out, a.shape[1],
        a.stride(0), *operand.strides(transposed), c.stride(0), BLOCK_M=tuning["block_m"],
        BLOCK_N=tuning["block_n"], BLOCK_K=tuning["block_k"], B_TABLE=not operand.stacked,
        GATHER_A=gather is not None, SCATTER_C=scatter is not None, num_warps=tuning["warps"],
        num_stages=tuning["stages"],
    )  # fmt: skip
    return c


def _row_tables(unread: torch.Tensor, *tables):
    """Row tables (contiguous int64, or None) as the kernels' arguments: ``unread`` in place of an absent one."""
    return tuple(unread if table is None else table for table in tables)


def matmul(a, tokens_per_expert, padded_rows: bool, table, weights, transposed: bool, gather=None,
           scatter=None) -> torch.Tensor:
    """The row-tile kernel on arguments of :func:`prepare`: for each expert e, a[rows of e] @ weight[e].T
    (``transposed``: the forward) or @ weight[e] (the input gradient); rows of no expert are zero.

    With ``gather`` ([N] int64) the kernel reads row i of a at a[gather[i]]; with ``scatter`` (a permutation of
    the N rows) it writes row i at c[scatter[i]], the zero rows of no expert included. So a and c may be in token
    order around rows sorted by expert (both tables the sort's order), without permuted copies."""
    operand, tuning = _Operand(weights, table), GEMM_TUNING[platform(a.device)]
    tiles = _shared_row_tiles(tokens_per_expert, a.shape[0], padded_rows, tuning["block_m"])
    n_out = operand.m_dim if transposed else operand.k_dim
    return _grouped_matmul(a, operand, transposed, n_out, tiles, tuning, gather, scatter)


def weight_grad(grad_out, x, tokens_per_expert, padded_rows: bool, weights, main_grads) -> torch.Tensor:
    """d weight[e] = grad_out[rows of e].T @ x[rows of e] as an [E, M, K] tensor in x's dtype; with ``main_grads``
    (from :func:`main_grad_target`) added to each weight's ``main_grad`` in fp32 instead, the weights marked as
    Megatron's hooks expect, and the [E, M, K] tensor an unwritten placeholder."""
    tuning = GEMM_TUNING[platform(x.device)]
    row_start = _shared_row_tiles(tokens_per_expert, x.shape[0], padded_rows, tuning["block_m"])[3]
    n_experts, (m_dim, k_dim) = tokens_per_expert.numel(), weights[0].shape[-2:]
    grad_w = None
    if main_grads is None or GRADIENT_PLACEHOLDERS["needed"]:
        grad_w = torch.empty((n_experts, m_dim, k_dim), dtype=x.dtype, device=x.device)
    target, table, aligned = grad_w, None, False
    if main_grads is not None:
        target, table, aligned = main_grads
    block_m, block_n = tuning["wgrad_block_m"], tuning["wgrad_block_n"]
    grid = (n_experts * cdiv(m_dim, block_m) * cdiv(k_dim, block_n),)
    launch(_grouped_weight_grad_kernel, grid, grad_out, x, target, target if table is None else table, row_start,
           tokens_per_expert, m_dim, k_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=tuning["wgrad_block_r"],
           W_TABLE=table is not None, W_ALIGNED=aligned, ACCUMULATE=table is not None,
           num_warps=tuning["wgrad_warps"], num_stages=tuning["wgrad_stages"])  # fmt: skip
    if main_grads is not None:  # grad_w is a placeholder (or None): Megatron's gradient hooks skip it, as for its
        for weight in weights:  # own layers with gradient-accumulation fusion, but need a gradient to fire
            weight.grad_added_to_main_grad = True
    return grad_w


def per_weight(grad_w: torch.Tensor | None, weights) -> tuple:
    """The weight gradient (or its placeholder) as autograd takes it: one tensor per weight; None each without one."""
    if grad_w is None:
        return (None,) * len(weights)
    return (grad_w,) if len(weights) == 1 else grad_w.unbind(0)


class GroupedGemm(torch.autograd.Function):
    """``(x, counts, padded_rows, table, *weights)`` from :func:`prepare`: weights one stacked [E, M, K] tensor
    (table None) or E [M, K] tensors at the offsets of ``table``."""

    @staticmethod
    def forward(ctx, x, tokens_per_expert, padded_rows, table, *weights):
        out = matmul(x, tokens_per_expert, padded_rows, table, weights, transposed=True)
        ctx.save_for_backward(x, tokens_per_expert)
        ctx.padded_rows, ctx.table, ctx.weights = padded_rows, table, weights
        ctx.main_grads = main_grad_target(weights)  # decided here: its offset table is not built during a capture
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, tokens_per_expert = ctx.saved_tensors
        grad_out, weights = grad_out.contiguous(), ctx.weights
        grad_x = matmul(grad_out, tokens_per_expert, ctx.padded_rows, ctx.table, weights, transposed=False)
        grad_w = weight_grad(grad_out, x, tokens_per_expert, ctx.padded_rows, weights, ctx.main_grads)
        return grad_x, None, None, None, *per_weight(grad_w, weights)


def main_grad_target(weights) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """Where the weight gradients go, decided in the forward: :func:`_main_grads` while accumulating into
    ``main_grad`` is enabled, else None (returned as tensors)."""
    main_grads = _main_grads(weights)  # (its offset table is built here even when off: not during a capture)
    return main_grads if ACCUMULATE_INTO_MAIN_GRAD["enabled"] else None


def _main_grads(weights) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """``(expert 0's main_grad, offsets of every expert's main_grad, whether they are multiples of 16 elements)``
    when each of the separate expert weights has a Megatron ``main_grad`` of its shape (one dtype), else None."""
    grads = [getattr(w, "main_grad", None) for w in weights]
    if len(weights) < 2 or not hasattr(weights[0], "grad_added_to_main_grad"):
        return None
    if any(g is None or g.shape != w.shape or g.dtype != grads[0].dtype or not g.is_contiguous()
           for g, w in zip(grads, weights)):
        return None
    table = _offset_table(grads, grads[0].device)  # None unless every offset is a multiple of 16 elements
    aligned = table is not None
    if not aligned:
        table = _offset_table(grads, grads[0].device, align=1)
    return grads[0], table, aligned


def grouped_gemm(x: torch.Tensor, weight, tokens_per_expert: torch.Tensor, padded_rows: bool = False) -> torch.Tensor:
    """Grouped GEMM over experts; same contract as ``ops.experts.grouped_gemm``.

    ``weight``: one [E, M, K] tensor, or a sequence of E [M, K] tensors (the experts' own parameters, read where
    they are: no stacked copy per call).
    """
    return GroupedGemm.apply(*prepare(x, weight, tokens_per_expert, padded_rows))


def prepare(x: torch.Tensor, weight, tokens_per_expert: torch.Tensor, padded_rows: bool):
    """The arguments of :func:`grouped_gemm`, checked -> ``(x, int64 counts, padded_rows, offset table or None,
    *weights)``: the weights as one [E, M, K] tensor (table None) or E [M, K] tensors read in place."""
    weights = [weight] if isinstance(weight, torch.Tensor) else list(weight)
    shapes = [list(w.shape) for w in weights]
    stacked = len(weights) == 1 and weights[0].dim() == 3
    if not stacked and any(w.dim() != 2 or w.shape != weights[0].shape for w in weights):
        raise ValueError(f"need weight [E, M, K] or E weights [M, K] of one shape; got {shapes}")
    n_experts, k_dim = (weights[0].shape[0] if stacked else len(weights)), weights[0].shape[-1]
    if x.dim() != 2 or k_dim != x.shape[1]:
        raise ValueError(f"need x [N, K] and weight [E, M, K]; got x {list(x.shape)}, weight {shapes}")
    if tokens_per_expert.shape != (n_experts,):
        raise ValueError(f"tokens_per_expert must have shape [{n_experts}], got {list(tokens_per_expert.shape)}")
    if tokens_per_expert.device.type == "cpu":
        routed = int(tokens_per_expert.sum())
        if routed > x.shape[0] or (not padded_rows and routed != x.shape[0]):
            raise ValueError(f"tokens_per_expert sums to {routed}, but x has {x.shape[0]} rows")
    if any(w.dtype != x.dtype for w in weights):
        raise ValueError(f"x ({x.dtype}) and weight ({weights[0].dtype}) must share a dtype")
    table = None
    if not stacked:  # in place: each expert's rows contiguous, at an offset the kernel's alignment hint holds for
        table = _offset_table(weights, x.device) if all(w.is_contiguous() for w in weights) else None
        if table is None:
            weights = [torch.stack(weights)]  # one copy
    weights = [w.contiguous() for w in weights]
    counts = tokens_per_expert.to(device=x.device, dtype=torch.int64)
    return x.contiguous(), counts, padded_rows, table, *weights


def runs_on(*tensors: torch.Tensor) -> bool:
    """Whether the kernels run on ``tensors``: all on a GPU, or the kernels are interpreted."""
    return triton_runs(_grouped_matmul_kernel, *tensors)
