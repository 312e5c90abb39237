"""``optim.weight_copies_on_device``: Megatron's copies between fp32 master weights and 16-bit model weights, through
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_weights_are_copied_into_16_bit_weights_as_their_casts(optimizer_module, dtype):
    """As the optimizer calls it: for bf16 with no overflow buffer, for fp16 with one."""
    masters, weights = _masters(), [torch.zeros(m.shape, dtype=dtype) for m in _masters()]
    overflow = torch.zeros(1, dtype=torch.int) if dtype == torch.float16 else None
    optimizer_module._multi_tensor_copy_this_to_that(masters, weights, overflow)
    for master, weight, original in zip(masters, weights, _masters()):
        assert torch.equal(weight, original.to(dtype))
        assert torch.equal(master, original)


def test_bf16_weights_are_copied_into_master_weights_exactly(optimizer_module):
    weights = [m.to(torch.bfloat16) for m in _masters()]
    masters = [torch.zeros(w.shape) for w in weights]
    optimizer_module._multi_tensor_copy_this_to_that(weights, masters, None)
    for master, weight in zip(masters, weights):
        assert torch.equal(master, weight.float())


def test_no_weights_is_nothing_to_copy(optimizer_module):
    optimizer_module._multi_tensor_copy_this_to_that([], [], None)
