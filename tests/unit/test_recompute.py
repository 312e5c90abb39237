"""Full activation recomputation gives the same gradients and the same router token counts, and recomputes the
layers that ``--recompute-method`` and ``--recompute-num-layers`` choose, as Megatron does."""

from __future__ import annotations

import pytest
import torch

from megatron_zaya.config import zaya_config
from megatron_zaya.model.recompute import full_recompute_segments
from megatron_zaya.pretrained import build_single_process_model

LAYERS = 4


def _run(recompute: tuple[str, int] | None, state=None):
    extra = {}
    if recompute is not None:
        extra = dict(recompute_granularity="full", recompute_method=recompute[0], recompute_num_layers=recompute[1])
    cfg = zaya_config("test", use_cpu_initialization=True, params_dtype=torch.float32, num_layers=LAYERS,
                      moe_token_dispatcher_type="allgather", **extra)
    model = build_single_process_model(cfg)
    if state is not None:
        model.load_state_dict(state)
    model.train()
    calls = [0] * LAYERS
    for index, layer in enumerate(model.decoder.layers):
        layer.register_forward_pre_hook(lambda *_, index=index: calls.__setitem__(index, calls[index] + 1))
    ids = torch.randint(0, cfg.vocab_size, (2, 15), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    counts = [layer.mlp.router.tokens_per_class.clone() for layer in model.decoder.layers]
    return model.state_dict(), grads, counts, calls


@pytest.mark.parametrize("method, per_chunk, forwards", [
    ("uniform", 1, [2, 2, 2, 2]), ("uniform", 3, [2, 2, 2, 2]), ("block", 1, [2, 1, 1, 1]), ("block", 3, [2, 2, 2, 1]),
    ("block", 0, [1, 1, 1, 1]),
])  # fmt: skip
def test_recompute_matches_plain_backward(method, per_chunk, forwards):
    state, plain_grads, plain_counts, plain_calls = _run(None)
    _, grads, counts, calls = _run((method, per_chunk), state=state)
    assert plain_calls == [1] * LAYERS and calls == forwards  # each recomputed layer runs its forward again
    assert set(grads) == set(plain_grads)
    for key, grad in plain_grads.items():
        torch.testing.assert_close(grads[key], grad, rtol=1e-6, atol=1e-7, msg=key)
    for ours, ref in zip(counts, plain_counts):
        assert torch.equal(ours, ref) and ref.sum() == 30  # counted once per token, not again on recompute


def test_uniform_chunks_keep_only_their_inputs():
    """A uniform run of N layers is one checkpoint (its layers' inputs but the first are not kept); the last run
    takes the layers left, as Megatron's ``_checkpointed_forward`` does."""
    assert full_recompute_segments(5, "uniform", 2) == [(range(0, 2), True), (range(2, 4), True), (range(4, 5), True)]
    assert full_recompute_segments(3, "block", 2) == [(range(0, 1), True), (range(1, 2), True), (range(2, 3), False)]
