"""Muon's Newton–Schulz Triton kernel (``gram``) and the iterations built on it at ZAYA1-8B shapes on a GPU
(CUDA or ROCm), against float64.

Skipped without a GPU. Run: ``python -m pytest -q tests/gpu/test_newton_schulz_gpu.py`` (seconds on an H200).
Each kernel result must be at least as close to a float64 evaluation as the plain torch path in the same
dtype (``assert_matches_oracle``), and the orthogonalised matrices must keep their singular values in the
band the coefficients promise.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from triton_interpreter import assert_matches_oracle

from megatron_zaya.kernels.newton_schulz import gram
from megatron_zaya.ops.newton_schulz import (
    QUINTIC_COEFFICIENTS,
    gram_newton_schulz_reference,
    gram_newton_schulz_triton,
    newton_schulz,
    newton_schulz_reference,
    newton_schulz_triton,
)
from megatron_zaya.optim import MatrixLayout, MuonConfig, ZayaMuon

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")

QUINTIC = (QUINTIC_COEFFICIENTS,) * 5
# (batch, m, n) with m <= n (tests that take [batch, n, m] run the tall path): experts fc1 (4096x2048), experts
# fc2, q, k, the router's 256x256.
SHAPES = [(16, 2048, 4096), (16, 2048, 2048), (1, 1024, 2048), (1, 256, 2048), (2, 256, 256), (3, 200, 333)]


def _randn(*shape, dtype=torch.bfloat16, seed=0):
    return torch.randn(*shape, generator=torch.Generator("cuda").manual_seed(seed), device="cuda").to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch,m,n", SHAPES)
def test_gram_and_fused_step(batch, m, n, dtype):
    X = _randn(batch, m, n, dtype=dtype) / n**0.5
    A = gram(X)
    assert_matches_oracle("X·Xᵀ", A, X.double() @ X.double().mT, X @ X.mT)
    assert torch.equal(A, A.mT)
    b, c = QUINTIC_COEFFICIENTS[1:]
    B = gram(A, alpha=c, aux=A, beta=b)
    oracle = b * A.double() + c * A.double() @ A.double()
    assert_matches_oracle("b·A + c·A·A", B, oracle, b * A + c * (A @ A))


def phi(sigma: torch.Tensor) -> torch.Tensor:
    """The scalar map 5 quintic steps apply to each normalised singular value."""
    for a, b, c in QUINTIC:
        sigma = a * sigma + b * sigma**3 + c * sigma**5
    return sigma


@pytest.mark.parametrize("batch,m,n", SHAPES)
def test_newton_schulz_triton_matches_torch(batch, m, n):
    G = _randn(batch, n, m, dtype=torch.float32, seed=1)  # rows > cols: the tall path (XᵀX, X·B)
    oracle = newton_schulz_reference(G.double(), QUINTIC, dtype=torch.float64)
    ours = newton_schulz_triton(G, QUINTIC, dtype=torch.bfloat16)
    reference = newton_schulz_reference(G, QUINTIC, dtype=torch.bfloat16)
    assert_matches_oracle("newton_schulz", ours, oracle, reference, rel_tol=2e-2)
    # Singular values: those of the input mapped through φ (float64 SVD), up to bf16 rounding.
    G2 = G[:2].double()
    sigma_hat = torch.linalg.svdvals(G2) / torch.linalg.matrix_norm(G2).unsqueeze(-1)
    expected = phi(sigma_hat).sort(dim=-1, descending=True).values
    assert (torch.linalg.svdvals(ours[:2].double()) - expected).abs().max() <= 0.05


def test_auto_backend_and_iteration(monkeypatch):
    """Triton from 512 rows and columns, torch below; the Gram form for wide bf16 matrices where it saves FLOPs."""
    import megatron_zaya.ops.newton_schulz as ns

    calls = []
    for name in ("newton_schulz_triton", "gram_newton_schulz_triton", "newton_schulz_reference",
                 "gram_newton_schulz_reference"):  # fmt: skip
        monkeypatch.setattr(ns, name, lambda *a, name=name, **k: calls.append((name, a[0].shape[-2:])) or a[0])
    G = _randn(4, 1024, 2048, dtype=torch.float32)
    ns.newton_schulz(G, QUINTIC)
    ns.newton_schulz(G, QUINTIC, iteration="standard")
    ns.newton_schulz(G, QUINTIC, dtype=torch.float32)  # fp32: the self-correcting standard iteration
    ns.newton_schulz(G[:, :, :1024], QUINTIC)  # square: no FLOPs saved
    ns.newton_schulz(G[:, :256], QUINTIC)  # below min_triton_dim: torch, 256×2048 saves FLOPs even there
    ns.newton_schulz(G[:, :256, :384], QUINTIC)  # ... 256×384 does not with general GEMMs
    assert calls == [("gram_newton_schulz_triton", (1024, 2048)), ("newton_schulz_triton", (1024, 2048)),
                     ("newton_schulz_triton", (1024, 2048)), ("newton_schulz_triton", (1024, 1024)),
                     ("gram_newton_schulz_reference", (256, 2048)), ("newton_schulz_reference", (256, 384))]


@pytest.mark.parametrize("batch,m,n", [s for s in SHAPES if s[1] != s[2]])
def test_gram_newton_schulz_at_zaya_shapes(batch, m, n):
    """The Gram form (fp16, one restart) against float64: as close as the standard bf16 torch path, within
    two bf16 steps of its own torch reference, singular values where φ puts them."""
    G = _randn(batch, n, m, dtype=torch.float32, seed=2)  # rows > cols: the tall path (XᵀX, X·B)
    oracle = newton_schulz_reference(G.double(), QUINTIC, dtype=torch.float64)
    ours = gram_newton_schulz_triton(G, QUINTIC, dtype=torch.bfloat16)
    assert_matches_oracle("gram newton_schulz", ours, oracle, newton_schulz_reference(G, QUINTIC, dtype=torch.bfloat16))
    torch_gram = gram_newton_schulz_reference(G, QUINTIC, dtype=torch.bfloat16)
    assert (ours.double() - torch_gram.double()).abs().max() <= 2**-7
    G2 = G[:2].double()
    sigma_hat = torch.linalg.svdvals(G2) / torch.linalg.matrix_norm(G2).unsqueeze(-1)
    expected = phi(sigma_hat).sort(dim=-1, descending=True).values
    assert (torch.linalg.svdvals(ours[:2].double()) - expected).abs().max() <= 0.02


def test_zaya_muon_step_with_triton_is_as_accurate_as_torch():
    """ZayaMuon updates on ZAYA1-8B shapes: bf16 Triton (Gram form where chosen) within twice the bf16 standard
    torch path's error (fp32 oracle)."""
    shapes = [(1024, 2048), (256, 2048), (2048, 1024), (4, 4096, 2048)]
    updates = {}
    for name, config in [("oracle", MuonConfig(ns_dtype=torch.float32, backend="torch")),
                         ("torch", MuonConfig(backend="torch", ns_gram=False)),
                         ("triton", MuonConfig(backend="triton"))]:  # fmt: skip
        params = [torch.nn.Parameter(_randn(*s, dtype=torch.float32, seed=i)) for i, s in enumerate(shapes)]
        start = [p.detach().clone() for p in params]
        layouts = {params[1]: MatrixLayout(row_blocks=2)}  # like linear_v's two halves
        optimizer = ZayaMuon(params, lr=0.01, layouts=layouts, config=config)
        for p in params:
            p.grad = _randn(*p.shape, dtype=torch.float32, seed=p.numel())
        optimizer.step()
        updates[name] = [p.detach() - s for p, s in zip(params, start)]
    for oracle, torch_path, ours in zip(updates["oracle"], updates["torch"], updates["triton"]):
        torch_error = (torch_path - oracle).norm()
        assert (ours - oracle).norm() <= 2 * torch_error
        assert torch_error <= 0.05 * oracle.norm()


def test_fp32_newton_schulz_is_accurate():
    G = _randn(2, 512, 1024, dtype=torch.float32, seed=3)
    oracle = newton_schulz_reference(G.double(), QUINTIC, dtype=torch.float64)
    ours = newton_schulz(G, QUINTIC, dtype=torch.float32, backend="triton")
    assert ((ours.double() - oracle).abs().max() / oracle.abs().max()).item() <= 1e-4


@pytest.mark.parametrize("shape", [(1024, 2048), (3, 256, 2048), (2048, 1024)])
def test_graphed_newton_schulz_equals_launches(shape, monkeypatch):
    """CUDA-graph replays run the same kernels: equal results, fresh ones per call, earlier results kept. Each
    graphed call is one replay (a failed capture would launch the kernels one by one, with a warning)."""
    coefficients = (QUINTIC_COEFFICIENTS,) * 5
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(shape, device="cuda", generator=gen) for _ in range(3)]
    eager = [newton_schulz(g, coefficients) for g in inputs]
    replays, replay = [], torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: replays.append(graph) or replay(graph))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed = [newton_schulz(g, coefficients, graphed=True) for g in inputs]
    assert not [w for w in caught if "CUDA graph" in str(w.message)], [str(w.message) for w in caught]
    assert len(replays) == 3 and len(set(map(id, replays))) == 1, replays
    for ours, ref in zip(graphed, eager):  # equal up to cuBLAS picking another algorithm inside the capture
        assert ((ours.float() - ref.float()).norm() / ref.float().norm()).item() <= 1e-2
    assert not torch.equal(graphed[0], graphed[1])
