"""Every trainable parameter gets a gradient from one backward pass: Megatron's overlapped gradient reduction
(``--overlap-grad-reduce``) waits for each one before it reduces a bucket, and hangs or asserts otherwise."""

import contextlib

import pytest
import torch
from op_by_op import count_calls
from triton_interpreter import install_model_kernels

from megatron_zaya.config import zaya_config
from megatron_zaya.ops import cca_sublayer as cca_sublayer_ops
from megatron_zaya.ops import moe as moe_ops
from megatron_zaya.pretrained import build_single_process_model


def test_one_backward_reaches_every_parameter():
    model = build_single_process_model(zaya_config("test", use_cpu_initialization=True, params_dtype=torch.float32))
    tokens = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    missing = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing
    # The first layer's EDA scale has no incoming router state: its gradient exists and is exactly zero.
    assert torch.equal(model.decoder.layers[0].mlp.router.eda_scale.grad, torch.zeros(32))


PER_KERNEL = "router,router_head,residual,cca,lm_head,experts"


@pytest.mark.parametrize("kernels", ["none", PER_KERNEL, PER_KERNEL + ",moe,cca_sublayer"],
                         ids=["torch", "op-by-op", "sublayer-ops"])
def test_the_forward_calls_the_module_of_every_parameter(kernels, model_kernels, monkeypatch):
    """Megatron's DDP waits for ``--overlap-param-gather``'s all-gather of a weight in a forward pre-hook of the
    module that holds it, which runs only when that module is called: a module whose weights the forward reads
    without calling it (a norm fused into its neighbour's kernel, the experts' grouped GEMMs, a sublayer op) would be
    read before its weights arrive. The kernels run interpreted, as on a GPU."""
    launched = set()
    install_model_kernels(monkeypatch, model_kernels,
                          lambda module, kernel: launched.add(kernel) or contextlib.nullcontext())
    one_op_calls = [count_calls(monkeypatch, op) for op in (cca_sublayer_ops.CCASublayer, moe_ops.MoESublayer)]
    config = zaya_config("test", use_cpu_initialization=True, params_dtype=torch.float32, kernels=kernels)
    model = build_single_process_model(config)
    called = set()
    for module in model.modules():
        module.register_forward_pre_hook(lambda module, args: called.add(module))
    tokens = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    model(tokens[:, :-1], labels=tokens[:, 1:])
    assert bool(launched) == (kernels != "none"), launched
    ops_ran = len(model.decoder.layers) if kernels.endswith("cca_sublayer") else 0
    assert [calls["forward"] for calls in one_op_calls] == [ops_ran, ops_ran]
    unwaited = [f"{name}.{param_name}" for name, module in model.named_modules() if module not in called
                for param_name, _ in module.named_parameters(recurse=False)]
    assert not unwaited, unwaited
