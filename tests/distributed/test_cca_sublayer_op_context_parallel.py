"""The ``cca_sublayer`` op under context parallelism (CP2, two gloo ranks): on every rank, the losses equal the
kernels run op by op bit for bit, and every parameter's gradient (into Megatron's ``main_grad``, before DDP's
reduction) but for the rounding of the sums the op's GEMMs add (``op_by_op.assert_same_gradient``), on one sequence
and on packed documents, with the default selective recomputation. The op exchanges the halos
of the convolutions and the value delay itself (``context_parallel.PrecedingRows``) and returns their gradients to
the ranks they came from; op by op, autograd runs Megatron's all-gather and its reduce-scatter. Kernels run in
Triton's interpreter (as in tests/unit/test_cca_sublayer_op.py)."""

from __future__ import annotations

import functools

import pytest
import torch
from gloo import run_ranks
from op_by_op import assert_same_gradient
from test_zaya_parallel import context_parallel_part

CP = 2
MODEL = dict(num_layers=1)  # the test model's other layer would only double the time
PER_KERNEL = "residual,cca"  # the rest of the model runs its torch references
TOKENS = (2, 8)  # chunks of 2 tokens: the convolutions' halo fills a whole chunk
# Per sequence: documents of 5 and 3 tokens (across chunk borders); of 2, 1, 3, 2 (two start chunks, one of a
# single token).
POSITIONS = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 0, 0, 1, 2, 0, 1]])


def op_step_worker(rank: int, world: int, packed: bool) -> dict:
    """This rank's part of a training step of the test model, with the kernels op by op and with the op."""
    from megatron.core import parallel_state as ps
    from op_by_op import initial_state, interpret_and_count, ready_calls, trained_step
    from triton_interpreter import load_kernel_module

    from megatron_zaya.ops.cca_sublayer import CCASublayer
    from megatron_zaya.patches import apply_patches

    apply_patches("cpu")
    ps.initialize_model_parallel(context_parallel_size=world)
    kernels = {name: load_kernel_module(f"megatron_zaya.kernels.{name}") for name in ("cca", "residual_rmsnorm")}
    with pytest.MonkeyPatch.context() as monkeypatch:
        calls = interpret_and_count(monkeypatch, kernels, CCASublayer)
        ready_calls(monkeypatch)  # off the graph with packed documents, as in test_cca_sublayer_op.py
        state = initial_state(**MODEL)
        step = functools.partial(trained_step, state=state, micro_batches=1, recompute=("layernorm", "cca_qk"),
                                 tokens=TOKENS, position_ids=POSITIONS if packed else None, on_the_graph=not packed,
                                 part=functools.partial(context_parallel_part, rank=rank, cp=world),
                                 context_parallel_size=world, **MODEL)
        _, losses, grads = step(PER_KERNEL)
        op_by_op_calls = dict(calls)
        _, one_op_losses, one_op_grads = step(PER_KERNEL + ",cca_sublayer")
    return {"losses": losses, "grads": grads, "one_op_losses": one_op_losses, "one_op_grads": one_op_grads,
            "op_by_op_calls": op_by_op_calls, "one_op_calls": dict(calls)}


@pytest.mark.parametrize("packed", [False, True], ids=["one-sequence", "packed-documents"])
def test_cca_sublayer_op_equals_the_kernels_op_by_op_under_context_parallelism(packed, tmp_path):
    for rank, result in enumerate(run_ranks(op_step_worker, CP, tmp_path, packed)):
        assert not result["op_by_op_calls"], rank
        assert result["one_op_calls"] == {"forward": 1, "backward": 1}, rank
        assert torch.equal(result["one_op_losses"], result["losses"]), rank
        for name, grad in result["grads"].items():
            assert_same_gradient(result["one_op_grads"][name], grad, (rank, name))
        assert all(grad.abs().sum() > 0 for name, grad in result["one_op_grads"].items()
                   if "self_attention" in name or "input_layernorm" in name), rank
