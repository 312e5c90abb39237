"""What the sublayer ops' tests share (test_moe_op.py, test_cca_sublayer_op.py): each op against its kernels run op
by op, in the test model as trained, under Megatron's DDP, the kernels run by Triton's interpreter."""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from triton_interpreter import install_model_kernels

from megatron_zaya.config import zaya_config
from megatron_zaya.pretrained import build_single_process_model


def assert_same_gradient(got: torch.Tensor, want: torch.Tensor, name) -> None:
    """A gradient of the op against the same op by op: equal but for rounding where the op adds a gradient of x into
    another by a GEMM (``addmm``) and autograd adds the two after their GEMMs; fp32, a few units in the last place."""
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * scale, msg=lambda m: f"{name}: {m}")


def interpret_and_count(monkeypatch, model_kernels, function: type[torch.autograd.Function]) -> Counter:
    """While the test runs, the model's ops run their kernels interpreted (``model_kernels``); counts the forwards
    and backwards of ``function``, a sublayer op."""
    install_model_kernels(monkeypatch, model_kernels, lambda module, kernel: contextlib.nullcontext())
    return count_calls(monkeypatch, function)


def count_calls(monkeypatch, function: type[torch.autograd.Function]) -> Counter:
    """While the test runs, counts the forwards and backwards of ``function``, a sublayer op."""
    calls = Counter()
    for name in ("forward", "backward"):
        original = getattr(function, name)

        def counted(*args, _original=original, _name=name):
            calls[_name] += 1
            return _original(*args)

        monkeypatch.setattr(function, name, staticmethod(counted))
    return calls


def ready_calls(monkeypatch) -> Counter:
    """Megatron's DDP with each parameter's ready call (the ``training_loop.gradient_ready_calls`` patch) while the
    test runs; counts the calls, which a sublayer op makes for each parameter it keeps off autograd's graph."""
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel

    from megatron_zaya.patches.training_loop import gradient_ready_calls
    from megatron_zaya.runtime import ensure_single_process_parallel_state

    ensure_single_process_parallel_state()  # the selected patches first, so that the test's own undo keeps them
    monkeypatch.setattr(DistributedDataParallel, "_make_backward_post_hook",
                        DistributedDataParallel._make_backward_post_hook)  # restored after the test
    gradient_ready_calls()
    patched, calls = DistributedDataParallel._make_backward_post_hook, Counter()

    def counting(self, param):
        hook = patched(self, param)
        ready = param.ddp_grad_ready

        def counted():
            calls["ready"] += 1
            ready()

        param.ddp_grad_ready = counted
        return hook

    monkeypatch.setattr(DistributedDataParallel, "_make_backward_post_hook", counting)
    return calls


def trained_step(kernels: str, state: dict, micro_batches: int, recompute: tuple[str, ...] = (),
                 tokens: tuple[int, int] = (2, 11), position_ids: torch.Tensor | None = None,
                 on_the_graph: bool = False, part=None, **overrides):
    """Micro-batches of ``tokens`` (batch, sequence) through the test model with ``state``, under Megatron's DDP
    (gradients accumulated into fp32 ``main_grad``), with selective recomputation of ``recompute`` (none where
    empty) and packed documents where ``position_ids`` are given. ``on_the_graph``: the parameters without DDP's
    ready call (as without the ``training_loop.gradient_ready_calls`` patch), so that a sublayer op returns their
    gradients to autograd and DDP's hooks. ``part``: under context parallelism, this rank's positions of a
    ``[b, S]`` tensor, taken from the ids and ``position_ids`` (the model then runs on them).

    Returns: the model, the losses, every parameter's ``main_grad``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    cfg = zaya_config("test", kernels=kernels, use_cpu_initialization=True, params_dtype=torch.float32,
                      recompute_granularity="selective" if recompute else None, recompute_modules=list(recompute),
                      **overrides)
    model = build_single_process_model(cfg)
    model.load_state_dict(state)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model).train()
    for param in model.parameters() if on_the_graph else ():
        del param.ddp_grad_ready
    part = part or (lambda sequences: sequences)
    positions = None if position_ids is None else part(position_ids)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(micro_batches):
        ids = part(torch.randint(0, cfg.vocab_size, tokens, generator=generator))
        loss = ddp(ids, position_ids=positions, labels=ids)
        loss.sum().backward()
        losses.append(loss.detach())
    return model, torch.stack(losses), {name: param.main_grad.clone() for name, param in model.named_parameters()}


def initial_state(**overrides) -> dict:
    """The test model's initial parameters and buffers, for both sides of a comparison."""
    return build_single_process_model(zaya_config("test", use_cpu_initialization=True, params_dtype=torch.float32,
                                                  **overrides)).state_dict()
