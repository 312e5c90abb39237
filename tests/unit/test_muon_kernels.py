"""The symmetric Newton–Schulz Triton kernels (standard and Gram iterations) vs plain float64, without a GPU.

* Interpreted (``TRITON_INTERPRET=1`` via ``triton_interpreter.load_kernel_module``, fp32: the interpreter's
  bf16 ``tl.dot`` is wrong) on small ragged shapes, so the masks, triangle indexing and mirroring run; the
  iterations of ``ops/newton_schulz.py`` run on the interpreted ``gram`` (``triton_interpreter.install``).
* Compiled for NVIDIA sm_90 and AMD gfx942 at ZAYA1-8B shapes (``compile_only``): no spills, shared memory
  within the chip's limit.
* The torch fallback where Triton is absent or there is no GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import megatron_zaya.kernels.newton_schulz as kernel_module
import megatron_zaya.ops.newton_schulz as ns
from triton_interpreter import SHARED_LIMIT, compile_only, gpu_target, install, load_kernel_module, register_spills
from megatron_zaya.kernels.utils import is_interpreted

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def interpreted():
    return load_kernel_module("megatron_zaya.kernels.newton_schulz", interpret=True)


def _assert_mirrored(out: torch.Tensor, block: int) -> None:
    """Off the diagonal tiles the upper triangle is the stored transpose of the lower one, bit for bit (a
    diagonal tile is one product, symmetric up to the rounding of its dot, which the float64 check bounds)."""
    tile = torch.arange(out.shape[-1]) // block
    mirrored = tile[:, None] != tile[None, :]
    assert torch.equal(out[:, mirrored], out.mT[:, mirrored])


@pytest.mark.parametrize("batch,m,k,block", [(1, 5, 7, 16), (3, 40, 72, 16), (2, 50, 33, 32)])
def test_gram_is_x_xt(interpreted, batch, m, k, block):
    Y = torch.randn(batch, m, k, generator=torch.Generator().manual_seed(m))
    out = interpreted.gram(Y, block_m=block, block_k=16)
    ref = Y.double() @ Y.double().mT
    assert torch.allclose(out.double(), ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    _assert_mirrored(out, block)


@pytest.mark.parametrize("batch,m,block", [(2, 37, 16), (1, 64, 32)])
def test_fused_polynomial_step(interpreted, batch, m, block):
    """B = b·A + c·A·A for a symmetric A, in one pass over the lower triangle."""
    X = torch.randn(batch, m, m + 9, generator=torch.Generator().manual_seed(m)) / m
    A = X @ X.mT
    b, c = -4.7750, 2.0315
    out = interpreted.gram(A, alpha=c, aux=A, beta=b, block_m=block, block_k=16)
    ref = b * A.double() + c * A.double() @ A.double()
    assert torch.allclose(out.double(), ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    _assert_mirrored(out, block)


@pytest.mark.parametrize("batch,m,block", [(2, 37, 16), (1, 40, 32)])
def test_gram_step_products(interpreted, batch, m, block):
    """The Gram iteration's products: P = a·I + b·A + c·A·A in one pass, and P·A, whose symmetry (P and A
    commute) lets one triangle stand for the whole."""
    X = torch.randn(batch, m, m + 9, generator=torch.Generator().manual_seed(m)) / m
    A = X @ X.mT
    a, b, c = 3.4445, -4.7750, 2.0315
    P = interpreted.gram(A, alpha=c, aux=A, beta=b, diag=a, block_m=block, block_k=16)
    A64 = A.double()
    ref = a * torch.eye(m, dtype=torch.float64) + b * A64 + c * A64 @ A64
    assert torch.allclose(P.double(), ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    PA = interpreted.gram(P, other=A, block_m=block, block_k=16)
    ref = P.double() @ A64
    assert torch.allclose(PA.double(), ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    _assert_mirrored(PA, block)
    with pytest.raises(ValueError, match="must match Y"):
        interpreted.gram(P, other=A[:, :-1])


@pytest.mark.parametrize("shape", [(40, 24), (3, 17, 50)])
def test_gram_newton_schulz_triton(interpreted, shape, monkeypatch):
    """In fp32 the Gram iteration meets the float64 standard iteration (the same map in exact arithmetic); asked
    for bf16 it works in fp16 and stays within two bf16 steps of its torch reference and 1e-2 of float64."""
    install(monkeypatch, interpreted)
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(6))
    coefficients = (ns.QUINTIC_COEFFICIENTS,) * 5
    ref = torch.from_numpy(_numpy_newton_schulz(G.double().numpy(), coefficients))
    out = ns.newton_schulz(G, coefficients, dtype=torch.float32, backend="triton", iteration="gram")
    assert out.shape == G.shape and out.dtype == torch.float32
    assert (out.double() - ref).abs().max() <= 2e-5
    out = ns.newton_schulz(G, coefficients, dtype=torch.bfloat16, backend="triton", iteration="gram")
    assert out.shape == G.shape and out.dtype == torch.bfloat16
    torch_gram = ns.gram_newton_schulz_reference(G, coefficients, dtype=torch.bfloat16)
    assert (out.double() - torch_gram.double()).abs().max() <= 2 * 2**-8
    assert (out.double() - ref).abs().max() <= 1e-2


@pytest.mark.parametrize("shape", [(2, 24, 40), (40, 24)])
def test_newton_schulz_triton_matches_reference(interpreted, shape, monkeypatch):
    install(monkeypatch, interpreted)
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
    coefficients = (ns.QUINTIC_COEFFICIENTS,) * 5
    ref = torch.from_numpy(_numpy_newton_schulz(G.double().numpy(), coefficients))
    out = ns.newton_schulz(G, coefficients, dtype=torch.float32, backend="triton")
    assert out.shape == G.shape
    assert (out.double() - ref).abs().max() <= 2e-5


def _numpy_newton_schulz(G, coefficients, eps=1e-7):
    """An independent float64 NumPy oracle (batched over leading axes)."""
    X = G / (np.sqrt((G**2).sum(axis=(-2, -1), keepdims=True)) + eps)
    transposed = X.shape[-2] > X.shape[-1]
    X = np.swapaxes(X, -1, -2) if transposed else X
    for a, b, c in coefficients:
        A = X @ np.swapaxes(X, -1, -2)
        X = a * X + (b * A + c * A @ A) @ X
    return np.swapaxes(X, -1, -2) if transposed else X


def test_auto_backend_uses_torch_on_cpu():
    """Without a GPU (and not interpreted) ``auto`` is the torch reference, and ``triton`` is refused clearly."""
    G = torch.randn(3, 16, 20, generator=torch.Generator().manual_seed(2))
    coefficients = (ns.QUINTIC_COEFFICIENTS,) * 5
    if not is_interpreted(kernel_module._gram_kernel):
        out = ns.newton_schulz(G, coefficients, dtype=torch.float32)
        assert torch.equal(out, ns.newton_schulz_reference(G, coefficients, dtype=torch.float32))
        with pytest.raises(RuntimeError, match="needs Triton and a GPU tensor"):
            ns.newton_schulz(G, coefficients, backend="triton")
    with pytest.raises(ValueError, match="unknown Newton–Schulz backend"):
        ns.newton_schulz(G, coefficients, backend="cuda")


# ZAYA1-8B Newton–Schulz operands (m <= n after the transpose): experts fc1 (16 at once), q, k.
ZAYA_SHAPES = [(16, 2048, 4096), (1, 1024, 2048), (1, 256, 2048)]


@pytest.mark.parametrize("target_name", ["sm_90", "gfx942"])
def test_kernels_compile_for_gpus_at_zaya_shapes(target_name, monkeypatch):
    module = load_kernel_module("megatron_zaya.kernels.newton_schulz", interpret=False)
    install(monkeypatch, module)
    target = gpu_target(target_name, module.triton)
    with compile_only(module, target) as compiled:
        for batch, m, n in ZAYA_SHAPES:
            X = torch.empty(batch, m, n, dtype=torch.bfloat16, device="meta")
            A = torch.empty(batch, m, m, dtype=torch.bfloat16, device="meta")
            module.gram(X)
            module.gram(A, alpha=2.0, aux=A, beta=-4.0)
            # the Gram iteration, in fp16: X·Xᵀ, a·I + b·A + c·A·A, P·A and P·Q
            ns.gram_newton_schulz_triton(X, (ns.QUINTIC_COEFFICIENTS,) * 5)
    assert len(compiled) >= 5  # bf16: X·Xᵀ, the fused step; fp16: the same, a·I + ... (equal ones compile once)
    for kernel in compiled:
        assert register_spills(kernel, target_name, module.triton) == 0, f"{kernel.name} spills on {target_name}"
        assert kernel.metadata.shared <= SHARED_LIMIT[target_name], f"{kernel.name} shared memory on {target_name}"
