"""``optim.weight_copies_on_device``: Megatron's copies between fp32 master weights and bf16 model weights, through
its own ``_multi_tensor_copy_this_to_that`` as ``Float16OptimizerWithFloat16Params`` calls it, against torch's
casts."""

from __future__ import annotations

import pytest
import torch

from megatron_zaya.patches import applied
from megatron_zaya.runtime import ensure_single_process_parallel_state


@pytest.fixture(scope="module")
def optimizer_module():
    from megatron.core.optimizer import optimizer

    ensure_single_process_parallel_state()  # applies the patches, as a run does
    assert "optim.weight_copies_on_device" in applied()
    return optimizer


def _masters():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen) for shape in ((7, 5), (11,), (3, 4, 2), (1,))]


def test_master_weights_are_copied_into_bf16_weights_as_their_casts(optimizer_module):
    masters, weights = _masters(), [torch.zeros(m.shape, dtype=torch.bfloat16) for m in _masters()]
    optimizer_module._multi_tensor_copy_this_to_that(masters, weights, torch.zeros(1, dtype=torch.int))
    for master, weight, original in zip(masters, weights, _masters()):
        assert torch.equal(weight, original.to(torch.bfloat16))
        assert torch.equal(master, original)


def test_bf16_weights_are_copied_into_master_weights_exactly(optimizer_module):
    weights = [m.to(torch.bfloat16) for m in _masters()]
    masters = [torch.zeros(w.shape) for w in weights]
    optimizer_module._multi_tensor_copy_this_to_that(weights, masters, torch.zeros(1, dtype=torch.int))
    for master, weight in zip(masters, weights):
        assert torch.equal(master, weight.float())


def test_a_scaled_copy_equals_the_product_cast(optimizer_module):
    masters, weights = _masters(), [torch.zeros(m.shape, dtype=torch.bfloat16) for m in _masters()]
    optimizer_module.multi_tensor_applier(optimizer_module.multi_tensor_scale_impl, None, [masters, weights], 0.3)
    for weight, original in zip(weights, _masters()):
        assert torch.equal(weight, (original * 0.3).to(torch.bfloat16))


def test_no_weights_is_nothing_to_copy(optimizer_module):
    optimizer_module._multi_tensor_copy_this_to_that([], [], torch.zeros(1, dtype=torch.int))
