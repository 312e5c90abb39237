"""``kernels.utils.matmul_fp32_into``, the weight gradients' addition into Megatron's ``main_grad``: the product summed
in fp32 and added to an fp32 or bf16 ``out`` with one rounding, against float64; into a bf16 ``out`` as one GEMM (one
launch, no fp32 temporary), as Megatron's bf16 gradient-accumulation fusion adds it."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_zaya.kernels.utils import matmul_fp32_into


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("accumulate", [True, False])
def test_matmul_fp32_into_rounds_once(out_dtype, accumulate):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(64, 512, generator=gen).bfloat16()
    b = torch.randn(512, 48, generator=gen).bfloat16()
    out = (torch.randn(64, 48, generator=gen) * 30).to(out_dtype)
    expected = (out.double() if accumulate else 0) + a.double() @ b.double()
    matmul_fp32_into(out, a, b, accumulate=accumulate)
    assert out.dtype == out_dtype
    # one rounding into out's dtype, plus the fp32 sum's error bound (K products, each rounding at most eps)
    rounding = torch.finfo(out_dtype).eps * expected.abs()
    fp32_sum = a.shape[1] * torch.finfo(torch.float32).eps * (a.double().abs() @ b.double().abs())
    assert ((out.double() - expected).abs() <= rounding + fp32_sum).all()


def test_a_bf16_main_grad_takes_one_gemm():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(32, 64, generator=gen).bfloat16(), torch.randn(64, 16, generator=gen).bfloat16()
    out = torch.randn(32, 16, generator=gen).bfloat16()
    with _Ops() as counted:
        matmul_fp32_into(out, a, b, accumulate=True)
    assert counted.ops == {"addmm_": 1}, counted.ops
