"""Packed documents: each position-0 starts a document, and every token's logits and every gradient equal
transformers' ZayaForCausalLM run on that token's document alone."""

from __future__ import annotations

import pytest
import torch
from test_hf_equivalence import ours_from_hf, relative_max_error
from zaya_reference import hf_config, random_hf_model

from megatron_zaya.convert.hf import hf_to_megatron
from megatron_zaya.model import core_attention

# Not the shipped presets: conv halos of 2 to 6 tokens, GQA 2, MQA 6 and MHA, sliding-window layers.
CONFIGS = {
    "gqa2-conv2x2": dict(),
    "mqa6-conv3x4": dict(num_attention_heads=6, num_key_value_heads=1, cca_time0=3, cca_time1=4),
    "mha4-conv1x3": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=8, cca_time0=1, cca_time1=3),
    "gqa2-sliding": dict(num_hidden_layers=4, sliding_window=3, cca_time0=4, cca_time1=2,
                         layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"]),
}
# Two packed sequences of 19 tokens: length-1 documents, documents shorter than every conv halo, one longer than
# the sliding window and the query block, documents back to back.
DOCUMENTS = [[5, 1, 2, 1, 7, 3], [1, 1, 9, 2, 6]]
QUERY_BLOCK = 4
# Gradients as in test_hf_equivalence: relative norm error, whose fp32 floor (summation order) reaches 6e-5 for
# the unpacked model against transformers already.
GRAD_RTOL = 1e-4  # several attention blocks per sequence, documents crossing block borders


def packed_batch(vocab_size: int, seed: int):
    ids = torch.randint(0, vocab_size, (len(DOCUMENTS), sum(DOCUMENTS[0])),
                        generator=torch.Generator().manual_seed(seed))
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in DOCUMENTS])
    return ids, positions


def documents_alone(hf_model, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits ``[b, s, V]``, every document of every sequence run on its own."""
    rows = []
    for row, lengths in zip(ids, DOCUMENTS, strict=True):
        pieces = row.split(lengths)
        rows.append(torch.cat([hf_model(piece[None]).logits[0] for piece in pieces]))
    return torch.stack(rows)


@pytest.fixture(params=sorted(CONFIGS))
def pair(request, monkeypatch):
    monkeypatch.setattr(core_attention, "DOCUMENT_QUERY_BLOCK", QUERY_BLOCK)
    hf_model = random_hf_model(hf_config(**CONFIGS[request.param]), seed=len(request.param))
    ours, cfg = ours_from_hf(hf_model)
    return request.param, hf_model, ours, cfg


def test_logits_and_gradients_equal_each_document_alone(pair):
    name, hf_model, ours, cfg = pair
    ids, positions = packed_batch(cfg.vocab_size, seed=1)
    weights = torch.randn(*ids.shape, cfg.vocab_size, generator=torch.Generator().manual_seed(2))
    ref = documents_alone(hf_model, ids)
    logits = ours.train()(ids, position_ids=positions)
    assert logits.shape == ref.shape
    assert relative_max_error(logits, ref) <= 1e-5, name
    with torch.no_grad():
        assert relative_max_error(ours(ids), ref) > 1e-2, name  # without position ids the documents mix

    (ref * weights).sum().backward()
    (logits * weights).sum().backward()
    ref_grads = {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in hf_model.named_parameters()}
    ref_grads.update({k: torch.zeros_like(b) for k, b in hf_model.named_buffers() if "balancing" in k})
    expected = hf_to_megatron(ref_grads, cfg)
    params = dict(ours.named_parameters())
    assert not params.pop("decoder.layers.0.mlp.router.eda_scale").grad.any()  # no router state to scale yet
    for key, param in params.items():
        ref = expected[key].double()
        error = ((param.grad.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()  # 0 if unused
        assert error <= GRAD_RTOL, (name, key, error)


def test_one_document_from_position_zero_is_the_causal_model():
    hf_model = random_hf_model(hf_config(), seed=7)
    ours, cfg = ours_from_hf(hf_model)
    ids = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        packed = ours.eval()(ids, position_ids=torch.arange(13).expand(2, 13))
        assert relative_max_error(packed, ours(ids)) <= 1e-6
