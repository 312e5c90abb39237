"""``optim.grad_norm_on_device`` and ``optim.params_norm_on_device``: Megatron's gradient norm and clipping (its
own ``get_grad_norm_fp32`` and ``clip_grad_by_total_norm_fp32``) and ``--log-params-norm``'s norm, with the patches'
multi-tensor functions, against float64. That the gradient's never waits for the device is checked on a GPU
(tests/gpu/test_host_sync_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_zaya.patches import applied
from megatron_zaya.runtime import ensure_single_process_parallel_state


@pytest.fixture(scope="module")
def clip_grads():
    """Megatron's ``clip_grads`` as a run patches it (on a CPU, the ``cpu`` group too), in a world of one."""
    from megatron.core.optimizer import clip_grads

    ensure_single_process_parallel_state()
    assert "optim.grad_norm_on_device" in applied()
    return clip_grads


def _gradients(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen).to(dtype) for shape in ((7, 5), (11,), (3, 4, 2), (1,))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gradient_norm_is_the_float64_norm(clip_grads, dtype):
    grads = _gradients(dtype)
    want = torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in grads])).item()
    norm = clip_grads.get_grad_norm_fp32(grads)
    assert norm == pytest.approx(want, rel=1e-6)


def test_clipping_scales_every_gradient_in_place(clip_grads):
    grads = _gradients()
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    total = clip_grads.get_grad_norm_fp32([p.grad for p in params])
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=0.5, total_norm=total)
    scale = 0.5 / (torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in grads])).item() + 1e-6)
    for param, grad in zip(params, grads):
        torch.testing.assert_close(param.grad.double(), grad.double() * scale, rtol=1e-6, atol=0)


def test_scaling_into_other_tensors_writes_them_and_leaves_the_sources(clip_grads):
    sources, destinations = _gradients(), [torch.empty(g.shape, dtype=torch.bfloat16) for g in _gradients()]
    clip_grads.multi_tensor_applier(clip_grads.multi_tensor_scale_impl, None, [sources, destinations], 0.25)
    for source, destination, original in zip(sources, destinations, _gradients()):
        assert torch.equal(source, original)
        assert torch.equal(destination, (original * 0.25).to(torch.bfloat16))


def test_clipping_no_gradient_does_nothing(clip_grads):
    """As Megatron calls it for an optimizer that holds no gradient."""
    clip_grads.clip_grad_by_total_norm_fp32([torch.nn.Parameter(torch.zeros(3))], max_norm=0.5, total_norm=2.0)


def test_the_params_norm_is_the_float64_norm(clip_grads):
    """``--log-params-norm``'s squared norm of a list of weights (``optim.params_norm_on_device``)."""
    from megatron.training.utils import common_utils

    assert "optim.params_norm_on_device" in applied()
    weights = _gradients()
    want = sum(torch.linalg.vector_norm(w.double()).item() ** 2 for w in weights)
    assert common_utils._compute_norm_2(weights).item() == pytest.approx(want, rel=1e-6)
