"""Training FLOPs per token of a ZAYA1 model, itemised by component (for TFLOP/s and MFU).

Conventions (Megatron's and PaLM's model-FLOPs accounting):

* a product ``[m, k] @ [k, n]`` costs ``2·m·k·n``; biases, norms, activations, softmax, RoPE, the QK-norm,
  residual scaling and the other elementwise work are not counted (O(D) per token against O(D²));
* the backward pass costs twice the forward (the gradient of the input and of the weight, each a product of
  the forward's size), so a training step is ``3 × forward``. Full activation recomputation
  (``--recompute-granularity full``) runs the layers' forward once more: ``recompute=True`` adds it, which
  gives *hardware* FLOPs; MFU is quoted on model FLOPs (``recompute=False``).

Per token, with D = hidden size, n_q / n_kv query / KV heads of d channels, F = expert width, R = router
width, E experts (+1 skip class), V = vocabulary, S = sequence length, ``cca_time0`` / ``cca_time1`` = t0 / t1
taps (shapes of ``megatron_zaya.model``):

``cca_projections``  q: 2·D·n_q·d, k: 2·D·n_kv·d, v: 2·D·n_kv·d (both halves; the delayed half is the same
    product, shifted), o: 2·n_q·d·D.
``cca_convolutions`` over the packed q‖k channels C = (n_q + n_kv)·d: the depthwise conv 2·C·t0 and the
    per-head grouped conv (each output channel mixes the d channels of its head over t1 taps) 2·C·d·t1.
``attention``        scores q·kᵀ and the weighted sum of values: 2·n_q·d each per (query, visible key)
    pair, i.e. 4·n_q·d·K where K is the mean number of keys a query sees: (S + 1) / 2 under the causal
    mask, (Σ_i min(i, w)) / S in a sliding layer of window w. ``count_masked=True`` counts all S keys, as
    ``FlopCounterMode`` does for SDPA (a flash kernel skips the masked blocks; the count does not).
``router``           down-projection 2·D·R, the two R×R layers 2·2·R², the logits 2·R·(E + 1), on every token.
``experts``          top-1 SwiGLU: fc1 (gate and up) 2·D·2F and fc2 2·F·D = 6·D·F, only for the tokens routed to
    an expert: a token that picks the skip class costs nothing. Routing is data-dependent, so the caller
    passes the measured ``routed_fraction`` (see :func:`routed_fraction`).
``lm_head``          2·D·V (the embedding lookup is free).

:func:`gqa_moe_forward_flops_per_token` counts a Megatron GPT-MoE with standard GQA attention at the same
width on the same conventions (no convolutions; Megatron's router is one D×E product; every token routed).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .config import ZayaConfig

TRAINING_MULTIPLIER = 3  # forward + backward (2 × forward)


def keys_per_query(seq_length: int, window: int | None = None, count_masked: bool = False) -> float:
    """Mean number of keys a query attends to: causal, optionally within a sliding window (itself included)."""
    if count_masked:
        return float(seq_length)
    if window is None or window >= seq_length:
        return (seq_length + 1) / 2
    visible = window * (window + 1) // 2 + (seq_length - window) * window  # min(i, w) for i = 1..S
    return visible / seq_length


def attention_flops(heads: int, head_dim: int, keys: float) -> float:
    """Scores and weighted values for one query: 2·heads·d per visible key, twice."""
    return 4 * heads * head_dim * keys


def forward_flops_per_token(cfg: ZayaConfig, seq_length: int, routed_fraction: float = 1.0,
                            count_masked: bool = False) -> dict[str, float]:
    """Forward FLOPs per token of the whole model, by component (see the module docstring)."""
    D, d, nq, nkv = cfg.hidden_size, cfg.kv_channels, cfg.num_attention_heads, cfg.num_query_groups
    R, F = cfg.router_hidden_size, cfg.moe_ffn_hidden_size
    conv_channels = (nq + nkv) * d
    per_layer = {
        "cca_projections": 2 * D * (nq * d + 2 * nkv * d) + 2 * nq * d * D,
        "cca_convolutions": 2 * conv_channels * cfg.cca_time0 + 2 * conv_channels * d * cfg.cca_time1,
        "router": 2 * (D * R + 2 * R * R + R * cfg.num_router_classes),
        "experts": routed_fraction * 6 * D * F,
    }
    layers = cfg.num_layers
    flops = {name: value * layers for name, value in per_layer.items()}
    flops["attention"] = sum(
        attention_flops(nq, d, keys_per_query(seq_length, cfg.sliding_window if kind == "sliding" else None,
                                              count_masked))
        for kind in cfg.attention_types
    )
    flops["lm_head"] = 2 * D * cfg.vocab_size
    return flops


def training_flops_per_token(cfg: ZayaConfig, seq_length: int, routed_fraction: float = 1.0,
                             recompute: bool = False) -> dict[str, float]:
    """FLOPs per token of one training step (forward + backward), by component.

    ``recompute=True``: the layers' forward runs again in the backward pass (full recomputation); the LM head,
    outside the recomputed layers, does not.
    """
    forward = forward_flops_per_token(cfg, seq_length, routed_fraction)
    repeats = TRAINING_MULTIPLIER + int(recompute)
    return {name: value * (TRAINING_MULTIPLIER if name == "lm_head" else repeats) for name, value in forward.items()}


def gqa_moe_forward_flops_per_token(*, num_layers: int, hidden_size: int, num_attention_heads: int,
                                    num_query_groups: int, kv_channels: int, num_experts: int,
                                    moe_ffn_hidden_size: int, topk: int, vocab_size: int, seq_length: int
                                    ) -> dict[str, float]:
    """Forward FLOPs per token of a GPT-MoE with causal GQA attention and SwiGLU experts (same conventions)."""
    D, d, nq, nkv = hidden_size, kv_channels, num_attention_heads, num_query_groups
    per_layer = {
        "attention_projections": 2 * D * (nq * d + 2 * nkv * d) + 2 * nq * d * D,
        "attention": attention_flops(nq, d, keys_per_query(seq_length)),
        "router": 2 * D * num_experts,
        "experts": topk * 6 * D * moe_ffn_hidden_size,
    }
    flops = {name: value * num_layers for name, value in per_layer.items()}
    flops["lm_head"] = 2 * D * vocab_size
    return flops


def routed_fraction(tokens_per_class: Sequence[float] | torch.Tensor, num_experts: int) -> float:
    """Share of tokens that went to an expert (not to the skip class), from per-class counts ``[E (+1)]``."""
    counts = torch.as_tensor(tokens_per_class, dtype=torch.float64)
    total = counts.sum().item()
    return counts[:num_experts].sum().item() / total if total else 1.0


__all__ = ["forward_flops_per_token", "training_flops_per_token", "gqa_moe_forward_flops_per_token",
           "keys_per_query", "routed_fraction"]
