"""Full activation recomputation gives the same gradients and the same router token counts."""

from __future__ import annotations

import torch

from megatron_zaya.config import zaya_config
from megatron_zaya.pretrained import build_single_process_model


def _run(recompute: bool, state=None):
    extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    cfg = zaya_config("test", use_cpu_initialization=True, params_dtype=torch.float32,
                      moe_token_dispatcher_type="allgather", **extra)
    model = build_single_process_model(cfg)
    if state is not None:
        model.load_state_dict(state)
    model.train()
    ids = torch.randint(0, cfg.vocab_size, (2, 15), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    counts = [layer.mlp.router.tokens_per_class.clone() for layer in model.decoder.layers]
    return model.state_dict(), grads, counts


def test_recompute_matches_plain_backward():
    state, plain_grads, plain_counts = _run(recompute=False)
    _, grads, counts = _run(recompute=True, state=state)
    assert set(grads) == set(plain_grads)
    for key, grad in plain_grads.items():
        torch.testing.assert_close(grads[key], grad, rtol=1e-6, atol=1e-7, msg=key)
    for ours, ref in zip(counts, plain_counts):
        assert torch.equal(ours, ref) and ref.sum() == 30  # counted once per token, not again on recompute
