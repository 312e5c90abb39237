"""``kernels.launch`` on a GPU: after a key's first call (Triton's path), calls run the cached kernel through its
launcher alone, and compute what Triton's path computes, for each specialization of the arguments."""

import pytest
import torch
import triton
import triton.language as tl

from megatron_zaya.kernels import launch as direct

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")


@triton.jit
def _scaled_shift(x_ptr, out_ptr, n, scale, shift, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n).to(tl.float32)
    tl.store(out_ptr + i, (x * scale + shift).to(out_ptr.dtype.element_ty), mask=i < n)


def _cases():
    """(x, out) pairs Triton specializes differently: dtypes, 16-byte aligned or not, 1 or 16 or 1000 elements."""
    fp32 = torch.randn(1024, device="cuda")
    bf16 = fp32.to(torch.bfloat16)
    return [(fp32[:1000], torch.empty(1000, device="cuda")), (fp32[1:1001], torch.empty(1001, device="cuda")[1:]),
            (bf16[:1000], torch.empty(1000, dtype=torch.bfloat16, device="cuda")),
            (fp32[:1], torch.empty(1, device="cuda")), (fp32[:16], torch.empty(16, device="cuda"))]  # fmt: skip


def _launch_all(cases):
    for x, out in cases:
        out.fill_(float("nan"))
        direct.launch(_scaled_shift, (triton.cdiv(x.numel(), 256),), x, out, x.numel(), 2.0, 0.5, BLOCK=256)
        torch.testing.assert_close(out, (x.float() * 2.0 + 0.5).to(out.dtype), rtol=0, atol=0)


def test_direct_launches_run_the_kernel_triton_would(monkeypatch):
    cases = _cases()
    _launch_all(cases)  # each key's first call: Triton's path, which compiles and caches
    assert len(direct._PLANS[id(_scaled_shift)].compiled) == len(cases)

    def no_triton_path(*args, **kwargs):
        raise AssertionError("a cached key took Triton's launch path")

    monkeypatch.setattr(_scaled_shift, "run", no_triton_path)
    _launch_all(cases)
    monkeypatch.undo()
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda metadata: None)  # a profiler's hook
    monkeypatch.setattr(_scaled_shift, "run", no_triton_path)
    with pytest.raises(AssertionError, match="Triton's launch path"):  # hooks see every launch
        _launch_all(cases[:1])


def test_a_host_tensor_is_refused_after_its_key_was_cached():
    """Cached launches pass device addresses, which the launcher no longer checks: a host tensor must not share a
    device tensor's key, so it takes Triton's path, which refuses it."""
    x, out = _cases()[0]
    _launch_all([(x, out)])
    with pytest.raises(ValueError, match="cannot be accessed from Triton"):
        direct.launch(_scaled_shift, (4,), x.cpu(), out, x.numel(), 2.0, 0.5, BLOCK=256)
