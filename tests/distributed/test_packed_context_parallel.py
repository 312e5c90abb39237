"""Packed documents under context parallelism: CP2 and CP4 give the one-rank per-token losses and gradients,
with documents that cross the chunk borders (and chunks shorter than the convolution halo of a document)."""

from __future__ import annotations

import pytest
import torch
from gloo import run_ranks
from test_zaya_parallel import context_parallel_part

SEQ = 32  # CP4: 8 chunks of 4 tokens, as long as the convolution halo below
TOKENS = torch.randint(0, 512, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
# Per sequence: length-1 documents, documents shorter than the halo, documents across several chunks.
DOCUMENTS = [[3, 1, 6, 2, 1, 9, 5, 5], [7, 1, 1, 13, 2, 8]]
POSITIONS = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in DOCUMENTS])
MODEL = dict(cca_time0=3, cca_time1=3, attention_types=["sliding", "global"], sliding_window=6)
RTOL = 1e-5


def packed_step_worker(rank: int, world: int, full_state: dict | None) -> dict:
    """One forward/backward of the packed batch on ``world`` CP ranks; gradients summed over them."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_zaya.config import zaya_config
    from megatron_zaya.model import build_zaya_model
    from megatron_zaya.patches import apply_patches

    apply_patches("cpu")
    ps.initialize_model_parallel(context_parallel_size=world)
    model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    cfg = zaya_config("test", use_cpu_initialization=True, params_dtype=torch.float32, skip_mode="identity",
                      moe_token_dispatcher_type="allgather", context_parallel_size=world, **MODEL)
    model = build_zaya_model(cfg)
    if full_state is not None:
        model.load_state_dict(full_state)
    inputs, labels, positions = (context_parallel_part(t, rank, world).contiguous()
                                 for t in (TOKENS[:, :-1], TOKENS[:, 1:], POSITIONS))
    losses = model(inputs, position_ids=positions, labels=labels)
    losses.sum().backward()
    grads = {name: param.grad for name, param in model.named_parameters() if param.grad is not None}
    for grad in grads.values():
        dist.all_reduce(grad)
    return {"losses": losses.detach(), "grads": grads, "state": model.state_dict() if full_state is None else None}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    (result,) = run_ranks(packed_step_worker, 1, tmp_path_factory.mktemp("reference"), None)
    return result


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_packed_documents_equal_one_rank(cp, reference, tmp_path):
    results = run_ranks(packed_step_worker, cp, tmp_path, reference["state"])
    for rank, result in enumerate(results):
        expected = context_parallel_part(reference["losses"], rank, cp)
        assert relative_error(result["losses"], expected) <= RTOL, rank
    for name, grad in results[0]["grads"].items():
        assert relative_error(grad, reference["grads"][name]) <= RTOL, name

