"""The symmetric Gram kernel of Muon's Newton–Schulz: ``gram`` computes ``alpha·Y Zᵀ + beta·aux (+ diag·I)``
for products known to be symmetric, one lower-triangle tile per program, each off-diagonal tile mirrored.

One kernel serves every symmetric product of the iteration: ``X Xᵀ`` (Z = Y), the fused step ``b·A + c·A·A``
(Y = Z = aux = A, since A·A = A·Aᵀ), the Gram form's ``a·I + b·A + c·A·A`` and its products of commuting
symmetric matrices (Z ≠ Y). Batched over a leading axis. The iterations built on it, their torch references and
the choice between them live in ``ops/newton_schulz.py``.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from .launch import launch
from .utils import cdiv, triton_runs


@triton.jit
def _gram_kernel(
    Y, Z, OUT, AUX, M, K,
    stride_yb, stride_ym, stride_yk,
    stride_zb, stride_zm, stride_zk,
    stride_ob, stride_om, stride_on,
    stride_ab, stride_am, stride_an,
    alpha, beta, diag,
    HAS_AUX: tl.constexpr, HAS_DIAG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """OUT[b] = alpha·Y[b]·Z[b]ᵀ (+ beta·AUX[b]) (+ diag·I) for Y, Z [B, M, K], a product known to be
    symmetric (Z = Y, or commuting symmetric Y and Z); one program per lower-triangle tile.

    Grid: (T·(T+1)/2, B) with T = cdiv(M, BLOCK_M). Program ``pid`` owns tile (i, j), j <= i, where
    pid = i·(i+1)/2 + j; it writes the tile and, off the diagonal, its transpose at (j, i).
    """
    pid = tl.program_id(0)
    batch = tl.program_id(1)
    i = ((tl.sqrt(8.0 * pid + 1.0) - 1.0) * 0.5).to(tl.int32)
    i = tl.where((i + 1) * (i + 2) // 2 <= pid, i + 1, i)  # undo float rounding of the sqrt
    i = tl.where(i * (i + 1) // 2 > pid, i - 1, i)
    j = pid - i * (i + 1) // 2

    rows = i * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = j * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    y = Y + batch * stride_yb
    z = Z + batch * stride_zb
    acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        left = tl.load(
            y + rows[:, None] * stride_ym + kk[None, :] * stride_yk,
            mask=(rows[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        )
        right_t = tl.load(  # Z[cols, kk]ᵀ, loaded as [BLOCK_K, BLOCK_M]
            z + cols[None, :] * stride_zm + kk[:, None] * stride_zk,
            mask=(cols[None, :] < M) & (kk[:, None] < K),
            other=0.0,
        )
        acc = tl.dot(left, right_t, acc, input_precision="ieee")
    acc = acc * alpha
    if HAS_AUX:
        aux = tl.load(
            AUX + batch * stride_ab + rows[:, None] * stride_am + cols[None, :] * stride_an,
            mask=(rows[:, None] < M) & (cols[None, :] < M),
            other=0.0,
        )
        acc += beta * aux.to(tl.float32)
    if HAS_DIAG:  # only diagonal tiles have rows == cols
        acc += tl.where(rows[:, None] == cols[None, :], diag, 0.0)
    tile = acc.to(OUT.dtype.element_ty)
    out = OUT + batch * stride_ob
    tl.store(
        out + rows[:, None] * stride_om + cols[None, :] * stride_on,
        tile,
        mask=(rows[:, None] < M) & (cols[None, :] < M),
    )
    if i != j:
        tl.store(
            out + cols[:, None] * stride_om + rows[None, :] * stride_on,
            tl.trans(tile),
            mask=(cols[:, None] < M) & (rows[None, :] < M),
        )


#: Below this many 128×128 lower-triangle tiles (over the whole batch) 64×64 tiles are used, so that a
#: single 1024-row matrix still spreads over more than 100 SMs / CUs. A heuristic, not a measurement:
#: ``benchmarks/bench_newton_schulz.py --block-m`` compares the choices on a GPU.
MIN_LARGE_TILE_PROGRAMS = 256


def _tile_sizes(Y: torch.Tensor, block_m: int | None, block_k: int | None) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, num_warps) for Y [B, M, K]; fp32 halves BLOCK_K (shared memory)."""
    if block_m is None:
        tiles = -(-Y.shape[-2] // 128)
        block_m = 128 if Y.shape[0] * tiles * (tiles + 1) // 2 >= MIN_LARGE_TILE_PROGRAMS else 64
    if block_k is None:
        block_k = 32 if Y.element_size() >= 4 else 64
    return block_m, block_k, 8 if block_m >= 128 else 4


def gram(
    Y: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    alpha: float = 1.0,
    aux: torch.Tensor | None = None,
    beta: float = 0.0,
    other: torch.Tensor | None = None,
    diag: float = 0.0,
    block_m: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """Triton: ``alpha·Y Zᵀ + beta·aux + diag·I`` for Y [B, M, K] (aux [B, M, M] symmetric) -> [B, M, M] in Y's
    dtype, with Z = ``other`` or Y. ``other`` is for products that are symmetric without being a Gram matrix:
    P·A with P, A symmetric polynomials in one matrix (then P·Aᵀ = P·A).

    Only the lower triangle of tiles is computed; the upper one is its mirror image. ``out`` must not alias an
    input.
    """
    if Y.dim() != 3:
        raise ValueError(f"gram expects Y of shape [batch, M, K], got {tuple(Y.shape)}")
    Z = Y if other is None else other
    if Z.shape != Y.shape or Z.dtype != Y.dtype:
        raise ValueError(f"gram: other {tuple(Z.shape)} {Z.dtype} must match Y {tuple(Y.shape)} {Y.dtype}")
    batch, M, K = Y.shape
    out = torch.empty(batch, M, M, device=Y.device, dtype=Y.dtype) if out is None else out
    block_m, block_k, num_warps = _tile_sizes(Y, block_m, block_k)
    tiles = cdiv(M, block_m)
    aux_t = aux if aux is not None else out  # never read when HAS_AUX is False
    launch(_gram_kernel, (tiles * (tiles + 1) // 2, batch),
        Y, Z, out, aux_t, M, K,
        *Y.stride(), *Z.stride(), *out.stride(), *aux_t.stride(),
        alpha, beta, diag,
        HAS_AUX=aux is not None, HAS_DIAG=diag != 0.0, BLOCK_M=block_m, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=3,
    )  # fmt: skip
    return out


def runs_on(*tensors: torch.Tensor) -> bool:
    """Whether ``gram`` runs on ``tensors``: all on a GPU, or the kernel is interpreted."""
    return triton_runs(_gram_kernel, *tensors)
