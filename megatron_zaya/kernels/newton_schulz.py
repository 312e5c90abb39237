"""Quintic Newton–Schulz orthogonalisation for Muon: a torch reference and Triton kernels.

One Newton–Schulz step on ``X`` ([batch, m, n], m <= n, spectral norm <= 1) is

    A = X Xᵀ                    # [m, m], symmetric
    B = b·A + c·A·A             # [m, m], symmetric (a polynomial in A)
    X = a·X + B·X

which maps every singular value σ of ``X`` to ``a·σ + b·σ³ + c·σ⁵`` and keeps the singular vectors, so a
few steps push all singular values into a band around 1 (Jordan et al., *Muon*, 2024; Liu et al.,
*Muon is scalable*, 2025).

The two kernels exploit the symmetry of ``A`` and ``B``: ``_gram_kernel`` computes only the lower
triangle of tiles of ``alpha·Y Yᵀ + beta·Aux`` and mirrors each off-diagonal tile, which serves both for
``X Xᵀ`` (Y = X) and for the fused ``b·A + c·A·A`` (Y = A, Aux = A, since A·A = A·Aᵀ). ``B·X`` stays a
plain batched GEMM (``torch.baddbmm`` also fuses the ``a·X +``). All kernels are batched over a leading
axis, so the 16 expert slices of a ZAYA1 MoE layer run in one launch.

``newton_schulz`` picks the backend: Triton on a GPU (or under ``TRITON_INTERPRET=1``), the torch
reference elsewhere or when Triton is absent.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # a CPU-only install without Triton: the torch path still works
    HAVE_TRITON = False

#: Keller Jordan's quintic coefficients (a, b, c): 5 steps map singular values in [~1e-3, 1] into ~[0.7, 1.2].
QUINTIC_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
DEFAULT_STEPS = 5
#: Triton kernels run on CPU tensors only when interpreted (this is read once, as Triton does).
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

Coefficients = Sequence[tuple[float, float, float]]


def _normalise(G: torch.Tensor, dtype: torch.dtype, eps: float) -> tuple[torch.Tensor, bool]:
    """Scale each [m, n] slice of ``G`` to Frobenius norm ~1 (so spectral norm <= 1) and make m <= n.

    The norm is taken in float32 before the cast to the working ``dtype``. Returns ``(X, transposed)``.
    """
    G = G.float()
    X = G / (torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=True) + eps)
    transposed = X.shape[-2] > X.shape[-1]
    if transposed:
        X = X.mT
    return X.to(dtype).contiguous(), transposed


def newton_schulz_reference(
    G: torch.Tensor, coefficients: Coefficients, eps: float = 1e-7, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Plain-torch Newton–Schulz: ``G`` [..., m, n] -> approximately orthogonal [..., m, n] in ``dtype``.

    ``coefficients`` holds one (a, b, c) triple per step.
    """
    X, transposed = _normalise(G, dtype, eps)
    for a, b, c in coefficients:
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X.mT if transposed else X


if HAVE_TRITON:

    @triton.jit
    def _gram_kernel(
        Y, OUT, AUX, M, K,
        stride_yb, stride_ym, stride_yk,
        stride_ob, stride_om, stride_on,
        stride_ab, stride_am, stride_an,
        alpha, beta,
        HAS_AUX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """OUT[b] = alpha·Y[b]·Y[b]ᵀ (+ beta·AUX[b]) for Y [B, M, K]; one program per lower-triangle tile.

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
        acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            left = tl.load(
                y + rows[:, None] * stride_ym + kk[None, :] * stride_yk,
                mask=(rows[:, None] < M) & (kk[None, :] < K),
                other=0.0,
            )
            right_t = tl.load(  # Y[cols, kk]ᵀ, loaded as [BLOCK_K, BLOCK_M]
                y + cols[None, :] * stride_ym + kk[:, None] * stride_yk,
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
    block_m: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """Triton: ``alpha·Y Yᵀ + beta·aux`` for Y [B, M, K] (aux [B, M, M] symmetric) -> [B, M, M] in Y's dtype.

    Only the lower triangle of tiles is computed; the upper one is its mirror image.
    """
    if not HAVE_TRITON:
        raise RuntimeError("newton_schulz.gram needs Triton; install triton or use backend='torch'")
    if Y.dim() != 3:
        raise ValueError(f"gram expects Y of shape [batch, M, K], got {tuple(Y.shape)}")
    batch, M, K = Y.shape
    out = torch.empty(batch, M, M, device=Y.device, dtype=Y.dtype) if out is None else out
    block_m, block_k, num_warps = _tile_sizes(Y, block_m, block_k)
    tiles = triton.cdiv(M, block_m)
    aux_t = aux if aux is not None else out  # never read when HAS_AUX is False
    _gram_kernel[(tiles * (tiles + 1) // 2, batch)](
        Y, out, aux_t, M, K,
        *Y.stride(), *out.stride(), *aux_t.stride(),
        alpha, beta,
        HAS_AUX=aux is not None, BLOCK_M=block_m, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=3,
    )  # fmt: skip
    return out


def newton_schulz_triton(
    G: torch.Tensor,
    coefficients: Coefficients,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
    *,
    block_m: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """Newton–Schulz with the symmetric Triton kernels: ``G`` [m, n] or [B, m, n] -> same shape in ``dtype``."""
    squeeze = G.dim() == 2
    X, transposed = _normalise(G.unsqueeze(0) if squeeze else G, dtype, eps)
    batch, m, _ = X.shape
    A = torch.empty(batch, m, m, device=X.device, dtype=dtype)
    B = torch.empty_like(A)
    for a, b, c in coefficients:
        gram(X, A, block_m=block_m, block_k=block_k)  # A = X Xᵀ
        gram(A, B, alpha=c, aux=A, beta=b, block_m=block_m, block_k=block_k)  # B = b·A + c·A·A
        X = torch.baddbmm(X, B, X, beta=a)  # X = a·X + B·X
    X = X.mT if transposed else X
    return X.squeeze(0) if squeeze else X


def triton_usable(G: torch.Tensor) -> bool:
    """Whether the Triton path can run on ``G``: Triton installed and a GPU tensor (or interpreter mode)."""
    return HAVE_TRITON and (G.is_cuda or TRITON_INTERPRETED)


def newton_schulz(
    G: torch.Tensor,
    coefficients: Coefficients,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
    min_triton_dim: int = 512,
) -> torch.Tensor:
    """Orthogonalise ``G`` [..., m, n] with ``len(coefficients)`` quintic steps; returns ``dtype``.

    ``backend``: ``torch`` (reference), ``triton`` (symmetric kernels, [m, n] or [B, m, n]; an error if
    unusable), or ``auto``: Triton for GPU tensors with min(m, n) >= ``min_triton_dim``, else torch (for
    small matrices cuBLAS is expected to win; check with ``benchmarks/bench_newton_schulz.py``).
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown Newton–Schulz backend {backend!r}; use auto, torch or triton")
    if backend == "triton" and not triton_usable(G):
        raise RuntimeError("Newton–Schulz backend 'triton' needs Triton and a GPU tensor (or TRITON_INTERPRET=1)")
    if backend == "triton" and G.dim() > 3:
        raise ValueError(f"Newton–Schulz backend 'triton' takes [m, n] or [batch, m, n], got {tuple(G.shape)}")
    use_triton = backend == "triton" or (
        backend == "auto" and HAVE_TRITON and G.is_cuda and min(G.shape[-2:]) >= min_triton_dim and G.dim() <= 3
    )
    if use_triton:
        return newton_schulz_triton(G, coefficients, eps, dtype)
    return newton_schulz_reference(G, coefficients, eps, dtype)
