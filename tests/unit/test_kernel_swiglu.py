"""SwiGLU Triton kernel (CPU interpreter) against its reference (ops/experts.py) in float64, incl. Megatron's
weighted/bias variants."""

import pytest
import torch

from triton_interpreter import assert_matches_oracle, load_kernel_module

from megatron_zaya.ops import experts as ops

kernels = load_kernel_module("megatron_zaya.kernels.swiglu")


def _run(fn, x, weights, bias, grad, dtype=None):
    leaves = [None if t is None else t.detach().to(dtype or t.dtype).requires_grad_() for t in (x, weights, bias)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, [t for t in leaves if t is not None], grad.to(out.dtype))
    return [out, *grads]


@pytest.mark.parametrize(
    "variant,dtype,block,rows",  # block 16: several column blocks per row; rows 2 or 4: a partial row tile
    [(v, *tile) for v in ("plain", "weighted", "bias") for tile in ((torch.float32, 16, 2), (torch.bfloat16, 4096, 1))]
    + [("weighted", torch.bfloat16, 16, 4)],
)
def test_swiglu_forward_backward(variant, dtype, block, rows, monkeypatch):
    tile = {"block": block, "rows": rows, "backward_block": block, "backward_rows": rows}
    monkeypatch.setitem(kernels.SWIGLU_TUNING, "cpu", {**kernels.SWIGLU_TUNING["cpu"], **tile})
    gen = torch.Generator().manual_seed(0)
    tokens, ffn = (3, 7), 40
    x = (2 * torch.randn(*tokens, 2 * ffn, generator=gen)).to(dtype)
    weights = torch.rand(*tokens, 1, generator=gen) if variant == "weighted" else None  # fp32 router probs
    bias = (0.5 * torch.randn(2 * ffn, generator=gen)).to(dtype) if variant == "bias" else None
    grad = torch.randn(*tokens, ffn, generator=gen)

    kernel = _run(kernels.swiglu, x, weights, bias, grad)
    reference = _run(ops.swiglu, x, weights, bias, grad)
    oracle = _run(ops.swiglu, x, weights, bias, grad, dtype=torch.float64)
    assert kernel[0].dtype == dtype and kernel[0].shape == (*tokens, ffn)
    for name, k, r, o in zip(["out", "d_x", "d_second"], kernel, reference, oracle):
        assert k.dtype == r.dtype
        assert_matches_oracle(name, k, o, r)


def test_reference_is_silu_gate_times_up_on_the_packed_layout():
    """fc1 rows [0, F) are the gate, [F, 2F) the up projection (ZAYA experts' gate_up_proj layout)."""
    gate, up = torch.randn(5, 6), torch.randn(5, 6)
    torch.testing.assert_close(ops.swiglu(torch.cat([gate, up], -1)), gate * torch.sigmoid(gate) * up)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="even"):
        kernels.swiglu(torch.randn(2, 5))
    with pytest.raises(ValueError, match="one scale per token"):
        kernels.swiglu(torch.randn(2, 8), torch.ones(3, 1))
