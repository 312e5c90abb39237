"""Muon's quintic Newton–Schulz orthogonalisation: the torch references, the cost model, the choice of
kernel and iteration, CUDA-graph replays, and the dispatcher ``newton_schulz``.

One Newton–Schulz step on ``X`` ([batch, m, n], m <= n, spectral norm <= 1) is

    A = X Xᵀ                    # [m, m], symmetric
    B = b·A + c·A·A             # [m, m], symmetric (a polynomial in A)
    X = a·X + B·X

which maps every singular value σ of ``X`` to ``a·σ + b·σ³ + c·σ⁵`` and keeps the singular vectors, so a
few steps push all singular values into a band around 1 (Jordan et al., *Muon*, 2024; Liu et al.,
*Muon is scalable*, 2025).

The Triton path exploits the symmetry of ``A`` and ``B``: ``gram`` (``kernels/newton_schulz.py``) computes only
the lower triangle of tiles of ``alpha·Y Zᵀ + beta·Aux (+ diag·I)`` and mirrors each off-diagonal tile, which
serves both for ``X Xᵀ`` (Y = Z = X) and for the fused ``b·A + c·A·A`` (Y = Z = A, Aux = A, since A·A = A·Aᵀ);
the Gram form below also uses it for ``a·I + b·A + c·A·A`` and for products of commuting symmetric matrices
(Z ≠ Y). ``B·X`` stays a plain batched GEMM (``torch.baddbmm`` also fuses the ``a·X +``). Everything is batched
over a leading axis, so the 16 expert slices of a ZAYA1 MoE layer run in one launch per product.

Gram Newton–Schulz. Every ``A`` of the iteration is a polynomial in ``A₀ = X₀X₀ᵀ``, and so is the
accumulated left factor ``Q`` with ``X = Q·X₀``. For a wide matrix (m < n) the steps can therefore run on
m×m matrices only, touching the m×n operand just twice:

    A = X₀ X₀ᵀ                 # the one m×m×n product that reads X₀
    P = a·I + b·A + c·A·A      # per step; P, A and Q commute, so every product below is symmetric
    Q = P·Q                    # (Q = P at the first step)
    A = P·A·P                  # = X_{k+1} X_{k+1}ᵀ, skipped after the last step
    X = Q · X₀                 # one general m×m·m×n GEMM

With symmetric kernels a segment of L steps costs 3m²n + (4L − 3)m³ FLOPs against L·(3m²n + m³) for the
standard iteration: fewer as soon as n > m, none for square matrices (``gram_is_cheaper`` is the rule).

The trade-off is numerical. The standard iteration recomputes ``A`` from ``X`` at every step, so its rounding
errors do not accumulate; the Gram form carries ``A`` and ``Q`` along instead, and in half precision:

* rounding makes tiny eigenvalues of ``A₀`` slightly negative, and the quintic map grows a negative eigenvalue
  without bound (−10⁻³ reaches −2.6 in three steps and explodes in the fourth);
* ``Q`` has a wide spectrum (≈ ∏a_k ≈ 41 after three steps on directions with tiny σ, ≈ 1 on the top ones),
  so its rounding error, relative to its largest entries, leaks into the top directions.

Hence two measures, both needed (``tests/unit/test_muon_orthogonalisation.py`` fails without either):

* **one restart**: ``A`` is recomputed from ``X = Q·X₀`` once ``∏|a_k|`` of a segment would pass
  ``GRAM_MAX_GAIN``, i.e. after step 3 of 5. It costs 3m²n − 3m³ FLOPs: at n = 2m the Gram form then needs
  1.35× fewer FLOPs than the symmetric standard iteration instead of 1.52×;
* **fp16**: whenever a 16-bit dtype is asked for, the Gram form works in fp16 (3 more mantissa bits than bf16,
  the same tensor-core rate; the input is normalised to Frobenius norm 1, so nothing overflows, and what
  underflows is below 6·10⁻⁸) and casts its result. fp32 would do too, but at half the rate (TF32) or a
  sixteenth (IEEE), which undoes the saving.

Measured against the float64 SVD oracle (singular values along the input's directions with σ̂ ≥ 10⁻³ in
the band φ([σ̂_min, 1]); spectral distance to U·φ(Σ̂)·Vᵀ), on random, condition-10⁶, power-law and
rank-4-plus-noise matrices of 24×40 to 2048×4096: fp16 with the restart stays in the band (within 10⁻³) at a
distance of 0.0025–0.06, where the standard iteration in bf16 stays in it (within 5·10⁻³) at 0.02–0.8. The
Gram form in bf16 with the restart is 6–10× further off than in fp16, and without a restart it leaves the
band (singular values of 900 and more in bf16, up to 2.9 in fp16, at condition 10⁶).

``newton_schulz`` picks the backend: Triton on a GPU (or under ``TRITON_INTERPRET=1``), the torch
reference elsewhere or when Triton is absent; and the iteration: Gram for 16-bit dtypes on GPU tensors
where it saves at least ``GRAM_MIN_SAVING`` of the FLOPs, the standard one otherwise (CPUs have no fast
fp16 GEMM; for fp32 and fp64 the self-correcting standard iteration is the accurate choice). Nothing here
imports triton: the kernel module is imported when the Triton path first runs.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

#: Keller Jordan's quintic coefficients (a, b, c): 5 steps map singular values in [~1e-3, 1] into ~[0.7, 1.2].
QUINTIC_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
DEFAULT_STEPS = 5

Coefficients = Sequence[tuple[float, float, float]]

#: Gram Newton–Schulz restarts (recomputes A from X) before a segment's gain on tiny singular values,
#: ∏|a_k|, would pass this: 3 of Keller Jordan's steps (3.4445³ ≈ 41) are validated in fp16, 4 (≈ 141) are not.
GRAM_MAX_GAIN = 48.0
#: ``newton_schulz(graphed=True)`` replays a CUDA graph for inputs of at most this many elements (a ZAYA1-8B
#: q, k, o, value or router matrix, alone or a few stacked); larger batches keep the GPU busy between launches.
GRAPH_MAX_NUMEL = 1 << 23
#: Gram Newton–Schulz is chosen only where it saves at least this fraction of the FLOPs: a margin for its
#: m×m products running at a lower FLOP rate than the m×n ones (a guess; ``bench_newton_schulz.py`` measures).
GRAM_MIN_SAVING = 0.1


def _normalise(G: torch.Tensor, dtype: torch.dtype, eps: float) -> tuple[torch.Tensor, bool]:
    """Scale each [m, n] slice of ``G`` to Frobenius norm ~1 (so spectral norm <= 1), in ``G``'s own layout.

    The norm and the quotient are taken in (at least) float32, then rounded to the working ``dtype`` in one
    pass. Returns ``(X, tall)``, ``tall`` when m > n: the iteration then runs on Xᵀ, through the helpers below.
    """
    norm = torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=True, dtype=torch.promote_types(G.dtype, torch.float32))
    X = torch.empty(G.shape, dtype=dtype, device=G.device)
    torch.div(G, norm + eps, out=X)
    return X, G.shape[-2] > G.shape[-1]


# A tall X (m > n) is orthogonalised as Xᵀ, without transposing it in memory: the short side's Gram matrix
# XᵀX = (Xᵀ)(Xᵀ)ᵀ, and B·Xᵀ = (X·B)ᵀ for the symmetric factors B of the iteration. A transposed copy is an
# uncoalesced pass over the matrix, twice per call (in and out).
def _short(X: torch.Tensor, tall: bool) -> torch.Tensor:
    """X as the iteration's wide operand [short, long]: a view."""
    return X.mT if tall else X


def _apply(B: torch.Tensor, X: torch.Tensor, tall: bool) -> torch.Tensor:
    """The wide iterate's ``B·X`` for a symmetric ``B``, in X's layout."""
    return _matmul(X, B) if tall else _matmul(B, X)


def _matmul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x @ y`` in their dtype. On a CPU a 16-bit product is taken in fp32 and rounded once: the 16-bit GEMM
    with fp32 accumulation that GPUs run (products of 16-bit values are exact in fp32), where CPUs without
    16-bit matrix units run torch's own 16-bit GEMM about 30x slower than fp32 (2-core AVX2 EPYC, torch 2.14)."""
    if x.device.type == "cpu" and x.dtype.itemsize == 2:
        return (x.float() @ y.float()).to(x.dtype)
    return x @ y


def newton_schulz_reference(
    G: torch.Tensor, coefficients: Coefficients, eps: float = 1e-7, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Plain-torch Newton–Schulz: ``G`` [..., m, n] -> approximately orthogonal [..., m, n] in ``dtype``.

    ``coefficients`` holds one (a, b, c) triple per step.
    """
    X, tall = _normalise(G, dtype, eps)
    for a, b, c in coefficients:
        A = _matmul(_short(X, tall), _short(X, tall).mT)
        B = b * A + c * _matmul(A, A)
        X = a * X + _apply(B, X, tall)
    return X


def gram_segments(coefficients: Coefficients) -> tuple[int, ...]:
    """Steps per segment of Gram Newton–Schulz: a restart starts a new segment before ∏|a_k| passes
    ``GRAM_MAX_GAIN`` (|a| bounds what a step multiplies tiny singular values by). Quintic ×5: (3, 2)."""
    segments: list[int] = []
    gain = float("inf")
    for a, _, _ in coefficients:
        if segments and gain * abs(a) <= GRAM_MAX_GAIN:
            segments[-1] += 1
            gain *= abs(a)
        else:
            segments.append(1)
            gain = abs(a)
    return tuple(segments)


def newton_schulz_flops(m: int, n: int, steps: int, *, symmetric: bool) -> float:
    """FLOPs of ``steps`` standard steps on an m×n matrix (either orientation): X·Xᵀ, A·A, B·X.

    ``symmetric``: X·Xᵀ and b·A + c·A·A compute one triangle (the Triton path), else all are general GEMMs.
    """
    m, n = sorted((m, n))
    return steps * ((3.0 * m * m * n + m**3) if symmetric else (4.0 * m * m * n + 2.0 * m**3))


def gram_newton_schulz_flops(m: int, n: int, segments: Sequence[int], *, symmetric: bool) -> float:
    """FLOPs of Gram Newton–Schulz on an m×n matrix (either orientation), with ``segments`` steps between restarts.

    A segment of L steps: X·Xᵀ (m²n), L × A·A, L − 1 × P·A·P (two products) and P·Q, then Q·X (2m²n, always
    general). With ``symmetric`` kernels the m×m products and X·Xᵀ cost half: 3m²n + (4L − 3)m³ per segment,
    else 4m²n + (8L − 6)m³.
    """
    m, n = sorted((m, n))
    if symmetric:
        return sum(3.0 * m * m * n + (4 * length - 3) * m**3 for length in segments)
    return sum(4.0 * m * m * n + (8 * length - 6) * m**3 for length in segments)


def gram_is_cheaper(
    m: int, n: int, coefficients: Coefficients, *, symmetric: bool, min_saving: float = GRAM_MIN_SAVING
) -> bool:
    """The shape rule: whether Gram Newton–Schulz needs fewer than ``1 − min_saving`` of the standard FLOPs.

    With symmetric kernels and one restart, Gram is cheaper exactly when the long side exceeds the short
    one; the 10 % margin asks for n ≥ 1.27m (ZAYA1-8B: q, k, o and the 4096×2048 expert fc1 qualify, the
    square expert fc2 does not). With general GEMMs (torch) it asks for n ≥ 1.9m.
    """
    standard = newton_schulz_flops(m, n, len(coefficients), symmetric=symmetric)
    ours = gram_newton_schulz_flops(m, n, gram_segments(coefficients), symmetric=symmetric)
    return ours < (1.0 - min_saving) * standard


def _gram_dtype(dtype: torch.dtype) -> torch.dtype:
    """Gram Newton–Schulz's working dtype: fp16 for 16-bit requests (bf16 is too coarse, see above), else ``dtype``."""
    return torch.float16 if dtype.itemsize == 2 else dtype


def gram_newton_schulz_reference(
    G: torch.Tensor, coefficients: Coefficients, eps: float = 1e-7, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Plain-torch Gram Newton–Schulz: ``G`` [..., m, n] -> [..., m, n] in ``dtype`` (computed in fp16 for
    16-bit ``dtype``s). Same result as ``newton_schulz_reference`` in exact arithmetic."""
    work = _gram_dtype(dtype)
    X, tall = _normalise(G, work, eps)
    eye = torch.eye(min(X.shape[-2:]), dtype=work, device=X.device)
    steps = iter(coefficients)
    for length in gram_segments(coefficients):
        A = _matmul(_short(X, tall), _short(X, tall).mT)
        for k in range(length):
            a, b, c = next(steps)
            P = a * eye + b * A + c * _matmul(A, A)
            Q = P if k == 0 else _matmul(P, Q)
            if k + 1 < length:
                A = _matmul(_matmul(P, A), P)
        X = _apply(Q, X, tall)
    return X.to(dtype)


# ----------------------------------------------------------------------------------------- the Triton path


def _kernel():
    from ..kernels import newton_schulz  # imported when first called: triton only where the Triton path runs

    return newton_schulz


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
    gram = _kernel().gram
    squeeze = G.dim() == 2
    X, tall = _normalise(G.unsqueeze(0) if squeeze else G, dtype, eps)
    batch, m = X.shape[0], min(X.shape[-2:])
    A = torch.empty(batch, m, m, device=X.device, dtype=dtype)
    B = torch.empty_like(A)
    for a, b, c in coefficients:
        gram(_short(X, tall), A, block_m=block_m, block_k=block_k)  # A = X Xᵀ
        gram(A, B, alpha=c, aux=A, beta=b, block_m=block_m, block_k=block_k)  # B = b·A + c·A·A
        X = torch.baddbmm(X, X, B, beta=a) if tall else torch.baddbmm(X, B, X, beta=a)  # X = a·X + B·X
    return X.squeeze(0) if squeeze else X


def gram_newton_schulz_triton(
    G: torch.Tensor,
    coefficients: Coefficients,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
    *,
    block_m: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """Gram Newton–Schulz with the symmetric Triton kernels: ``G`` [m, n] or [B, m, n] -> same shape in ``dtype``.

    Works in ``_gram_dtype(dtype)``; per batch, four m×m buffers besides X.
    """
    gram = _kernel().gram
    squeeze = G.dim() == 2
    X, tall = _normalise(G.unsqueeze(0) if squeeze else G, _gram_dtype(dtype), eps)
    m = min(X.shape[-2:])
    A, P, Q, free = (torch.empty(X.shape[0], m, m, device=X.device, dtype=X.dtype) for _ in range(4))
    tiles = dict(block_m=block_m, block_k=block_k)
    steps = iter(coefficients)
    for length in gram_segments(coefficients):
        gram(_short(X, tall), A, **tiles)  # A = X Xᵀ
        for k in range(length):
            a, b, c = next(steps)
            step = Q if k == 0 else P  # the first step's P is the segment's Q
            gram(A, step, alpha=c, aux=A, beta=b, diag=a, **tiles)  # P = a·I + b·A + c·A·A
            if k > 0:
                gram(P, free, other=Q, **tiles)  # Q = P·Q
                Q, free = free, Q
            if k + 1 < length:
                gram(step, free, other=A, **tiles)  # free = P·A
                gram(free, A, other=step, **tiles)  # A = P·A·P
        X = torch.bmm(X, Q) if tall else torch.bmm(Q, X)
    X = X.to(dtype)
    return X.squeeze(0) if squeeze else X


def triton_usable(G: torch.Tensor) -> bool:
    """Whether the Triton path can run on ``G``: a GPU tensor (or the kernels interpreted)."""
    return _kernel().runs_on(G)


# ----------------------------------------------------------------------------------------- the choice


def newton_schulz_path(
    G: torch.Tensor,
    coefficients: Coefficients,
    dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
    min_triton_dim: int = 512,
    iteration: str = "auto",
) -> tuple[bool, bool]:
    """``(triton, gram)``: whether ``newton_schulz`` runs the Triton kernels and the Gram form on ``G``."""
    use_triton = backend == "triton" or (
        backend == "auto" and G.is_cuda and min(G.shape[-2:]) >= min_triton_dim and G.dim() <= 3
    )
    use_gram = iteration == "gram" or (
        iteration == "auto"
        and G.is_cuda
        and dtype.itemsize == 2
        and gram_is_cheaper(*G.shape[-2:], coefficients, symmetric=use_triton)
    )
    return use_triton, use_gram


class _GraphedNewtonSchulz:
    """One Newton–Schulz call captured as a CUDA graph for inputs of one shape: replays copy the input into a
    static buffer and return a copy of the static output (so earlier results survive later replays)."""

    def __init__(self, G: torch.Tensor, run):
        self.static_input = G.clone()
        side = torch.cuda.Stream(G.device)
        side.wait_stream(torch.cuda.current_stream(G.device))
        with torch.cuda.stream(side):
            run(self.static_input)  # compiles the Triton kernels and picks cuBLAS algorithms outside the capture
        torch.cuda.current_stream(G.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.static_output = run(self.static_input)

    def __call__(self, G: torch.Tensor) -> torch.Tensor:
        self.static_input.copy_(G)
        self.graph.replay()
        return self.static_output.clone()


_GRAPHS: dict[tuple, _GraphedNewtonSchulz | None] = {}  # None: the capture failed, launch one by one


def newton_schulz(
    G: torch.Tensor,
    coefficients: Coefficients,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
    min_triton_dim: int = 512,
    iteration: str = "auto",
    graphed: bool = False,
) -> torch.Tensor:
    """Orthogonalise ``G`` [..., m, n] with ``len(coefficients)`` quintic steps; returns ``dtype``.

    ``backend``: ``torch`` (reference), ``triton`` (symmetric kernels, [m, n] or [B, m, n]; an error if
    unusable), or ``auto``: Triton for GPU tensors with min(m, n) >= ``min_triton_dim``, else torch (for
    small matrices cuBLAS is expected to win; check with ``benchmarks/bench_newton_schulz.py``).

    ``iteration``: ``standard``, ``gram`` (Gram Newton–Schulz, see the module docstring), or ``auto``: Gram for
    GPU tensors in a 16-bit ``dtype`` where ``gram_is_cheaper`` (with the chosen backend's kernels), else standard.

    ``graphed``: on a CUDA/ROCm device, run inputs of at most ``GRAPH_MAX_NUMEL`` elements as a replay of a CUDA
    graph captured at the first call for their shape (the same kernels; one graph, and its memory, is kept per
    shape and settings). Small matrices are bound by the host's ~40–70 launches per call, not by the GPU.
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown Newton–Schulz backend {backend!r}; use auto, torch or triton")
    if iteration not in ("auto", "standard", "gram"):
        raise ValueError(f"unknown Newton–Schulz iteration {iteration!r}; use auto, standard or gram")
    if backend == "triton" and not triton_usable(G):
        raise RuntimeError("Newton–Schulz backend 'triton' needs Triton and a GPU tensor (or TRITON_INTERPRET=1)")
    if backend == "triton" and G.dim() > 3:
        raise ValueError(f"Newton–Schulz backend 'triton' takes [m, n] or [batch, m, n], got {tuple(G.shape)}")
    use_triton, use_gram = newton_schulz_path(G, coefficients, dtype, backend, min_triton_dim, iteration)
    if use_triton:
        implementation = gram_newton_schulz_triton if use_gram else newton_schulz_triton
    else:
        implementation = gram_newton_schulz_reference if use_gram else newton_schulz_reference
    coefficients = tuple(tuple(c) for c in coefficients)

    def run(X: torch.Tensor) -> torch.Tensor:
        return implementation(X, coefficients, eps, dtype)

    if graphed and G.is_cuda and G.numel() <= GRAPH_MAX_NUMEL and not torch.cuda.is_current_stream_capturing():
        key = (tuple(G.shape), G.dtype, G.device, coefficients, eps, dtype, implementation)
        if key not in _GRAPHS:
            try:
                _GRAPHS[key] = _GraphedNewtonSchulz(G, run)
            except RuntimeError as error:  # a platform whose kernels cannot be captured: say so once, go on
                warnings.warn(f"Newton–Schulz on {tuple(G.shape)} could not be captured as a CUDA graph "
                              f"({str(error).splitlines()[0][:120]}); launching its kernels one by one")
                _GRAPHS[key] = None
        if _GRAPHS[key] is not None:
            return _GRAPHS[key](G)
    return run(G)
