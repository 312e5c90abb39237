"""Gram Newton–Schulz: its FLOP counts and shape rule, the iteration ``newton_schulz`` picks, and the
``--zaya-muon-ns-gram`` flag. Its numerics are in test_muon_orthogonalisation.py, its Triton
kernels in test_muon_kernels.py.

The FLOP formulas are checked against counts of the operations the implementations run: torch's
``FlopCounterMode`` for the plain-torch references (general GEMMs), and for the Triton paths a stand-in
for the symmetric kernel that computes in NumPy and counts half a GEMM per call.
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import megatron_zaya.kernels.newton_schulz as kernel_module
import megatron_zaya.ops.newton_schulz as ns
import megatron_zaya.optim.muon as muon_module
from megatron_zaya.optim import MuonConfig, ZayaMuon, add_muon_args, muon_config_from_args

QUINTIC = (ns.QUINTIC_COEFFICIENTS,) * 5
BATCH = 2  # the counts cover a batch of two matrices; the formulas are per matrix


def counted_flops(fn, *args, **kwargs) -> int:
    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return counter.get_total_flops()


@pytest.fixture
def symmetric_kernel_flops(monkeypatch) -> list[int]:
    """Replace the Triton ``gram`` by a NumPy stand-in; returns the list its calls append their FLOPs to:
    B·M·M·K, one triangle of B [M, K]·[K, M] products."""
    calls: list[int] = []

    def numpy_gram(Y, out=None, *, alpha=1.0, aux=None, beta=0.0, other=None, diag=0.0, **_):
        Z = Y if other is None else other
        batch, M, K = Y.shape
        calls.append(batch * M * M * K)
        result = alpha * (Y.double().numpy() @ Z.double().numpy().swapaxes(-1, -2)) + diag * np.eye(M)
        if aux is not None:
            result += beta * aux.double().numpy()
        result = torch.from_numpy(result).to(Y.dtype)
        if out is None:
            return result
        return out.copy_(result)

    monkeypatch.setattr(kernel_module, "gram", numpy_gram)  # ops.newton_schulz looks it up at each call
    return calls


@pytest.mark.parametrize("m,n", [(24, 40), (40, 24), (16, 16), (8, 56)])
def test_flop_formulas_count_the_torch_references(m, n):
    G = torch.randn(BATCH, m, n, generator=torch.Generator().manual_seed(m))
    assert counted_flops(ns.newton_schulz_reference, G, QUINTIC) == BATCH * ns.newton_schulz_flops(
        m, n, 5, symmetric=False)  # fmt: skip
    assert counted_flops(ns.gram_newton_schulz_reference, G, QUINTIC) == BATCH * ns.gram_newton_schulz_flops(
        m, n, (3, 2), symmetric=False)  # fmt: skip


@pytest.mark.parametrize("m,n", [(24, 40), (40, 24), (16, 16)])
def test_flop_formulas_count_the_symmetric_kernels(symmetric_kernel_flops, m, n):
    G = torch.randn(BATCH, m, n, generator=torch.Generator().manual_seed(m))
    general = counted_flops(ns.newton_schulz_triton, G, QUINTIC, dtype=torch.float32)  # B·X (baddbmm)
    assert general + sum(symmetric_kernel_flops) == BATCH * ns.newton_schulz_flops(m, n, 5, symmetric=True)
    symmetric_kernel_flops.clear()
    general = counted_flops(ns.gram_newton_schulz_triton, G, QUINTIC, dtype=torch.float32)  # Q·X (bmm)
    assert general + sum(symmetric_kernel_flops) == BATCH * ns.gram_newton_schulz_flops(m, n, (3, 2),
                                                                                        symmetric=True)
    # what was counted is the iteration: with the stand-in kernels it computes the polar factor's approximation
    out = ns.gram_newton_schulz_triton(G, QUINTIC, dtype=torch.float32)
    assert (out - ns.newton_schulz_reference(G, QUINTIC)).abs().max() <= 1e-5


def test_restart_segments():
    assert ns.gram_segments(QUINTIC) == (3, 2)  # 3.4445³ ≈ 41 <= 48 < 3.4445⁴
    assert ns.gram_segments(((1.5, -0.5, 0.0),) * 12) == (9, 3)  # 1.5⁹ ≈ 38
    assert ns.gram_segments(((100.0, -1.0, 0.0),) * 3) == (1, 1, 1)  # a restart every step: nothing saved
    assert not ns.gram_is_cheaper(256, 4096, ((100.0, -1.0, 0.0),) * 3, symmetric=True)


@pytest.mark.parametrize(
    "rows,cols,gram",
    [(4096, 2048, True), (2048, 4096, True), (2048, 2048, False), (1024, 2048, True), (2048, 1024, True),
     (256, 2048, True), (256, 256, False), (17, 256, True)],
)  # fmt: skip
def test_shape_rule_at_zaya_shapes(rows, cols, gram):
    """ZAYA1-8B's matrices with the symmetric kernels: all but the square ones take the Gram form."""
    assert ns.gram_is_cheaper(rows, cols, QUINTIC, symmetric=True) is gram


def test_shape_rule_thresholds():
    """By hand, with one restart (segments 3 and 2) and a 10% margin: Gram needs 6m²n + 14m³ <= 0.9·(15m²n + 5m³)
    FLOPs with symmetric kernels, i.e. n >= 19/15·m; with general GEMMs 8m²n + 28m³ <= 0.9·(20m²n + 10m³),
    i.e. n >= 1.9m."""
    assert not ns.gram_is_cheaper(300, 379, QUINTIC, symmetric=True)
    assert ns.gram_is_cheaper(300, 381, QUINTIC, symmetric=True)
    assert not ns.gram_is_cheaper(100, 189, QUINTIC, symmetric=False)
    assert ns.gram_is_cheaper(100, 191, QUINTIC, symmetric=False)
    assert ns.gram_is_cheaper(300, 301, QUINTIC, symmetric=True, min_saving=0.0)  # any n > m saves something
    assert not ns.gram_is_cheaper(300, 300, QUINTIC, symmetric=True, min_saving=0.0)


@pytest.mark.parametrize("m,n", [(8, 24), (10, 14), (12, 40), (20, 21)])
def test_shape_rule_agrees_with_counted_flops(m, n):
    G = torch.randn(m, n, generator=torch.Generator().manual_seed(n))
    standard = counted_flops(ns.newton_schulz_reference, G, QUINTIC)
    gram = counted_flops(ns.gram_newton_schulz_reference, G, QUINTIC)
    assert ns.gram_is_cheaper(m, n, QUINTIC, symmetric=False) is (gram <= 0.9 * standard)


def test_iteration_choice_without_a_gpu():
    """On CPU tensors ``auto`` keeps the standard iteration (no fast fp16 GEMM); ``gram`` forces the Gram form."""
    G = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))
    assert ns.gram_is_cheaper(16, 64, QUINTIC, symmetric=False)
    auto = ns.newton_schulz(G, QUINTIC, backend="torch")
    assert torch.equal(auto, ns.newton_schulz_reference(G, QUINTIC, dtype=torch.bfloat16))
    forced = ns.newton_schulz(G, QUINTIC, backend="torch", iteration="gram")
    assert torch.equal(forced, ns.gram_newton_schulz_reference(G, QUINTIC, dtype=torch.bfloat16))
    assert not torch.equal(forced, auto)
    with pytest.raises(ValueError, match="unknown Newton–Schulz iteration"):
        ns.newton_schulz(G, QUINTIC, iteration="fast")


def test_gram_flag_reaches_the_optimizer(monkeypatch):
    parser = argparse.ArgumentParser()
    add_muon_args(parser)
    assert muon_config_from_args(parser.parse_args([])).ns_gram is True
    assert muon_config_from_args(parser.parse_args(["--zaya-muon-ns-gram", "off"])).ns_gram is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--zaya-muon-ns-gram", "on"])
    with pytest.raises(ValueError, match=r"ns_gram is a boolean \(--zaya-muon-ns-gram auto\|off\)"):
        MuonConfig(ns_gram="always")

    iterations = []
    original = muon_module.newton_schulz

    def recording(*args, **kwargs):
        iterations.append(kwargs.get("iteration"))
        return original(*args, **kwargs)

    monkeypatch.setattr(muon_module, "newton_schulz", recording)
    for flag in ("auto", "off"):
        param = torch.nn.Parameter(torch.randn(8, 24))
        param.grad = torch.randn(8, 24)
        ZayaMuon([param], config=muon_config_from_args(parser.parse_args(["--zaya-muon-ns-gram", flag]))).step()
    assert iterations == ["auto", "standard"]
