"""megatron_zaya.flops against torch's FlopCounterMode counting the real model, and masks counted by hand.

FlopCounterMode counts matmuls, convolutions and (on the math backend) attention as full S×S products: it
does not know the causal mask. So the model-level tests compare with ``count_masked=True`` and the mask
accounting is checked on its own, against the pairs that ``sliding_window_mask`` (the model's mask) lets through.
torch's formula for a convolution's backward ignores groups (its docstring says it skips them), which
overcounts the grouped and depthwise convs; the counter here uses a grouped one: the input gradient and the
weight gradient each cost the forward's products.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.ops import aten
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

from megatron_zaya.config import zaya_config
from megatron_zaya.flops import (forward_flops_per_token, gqa_moe_forward_flops_per_token, keys_per_query,
                                 routed_fraction, training_flops_per_token)
from megatron_zaya.model.core_attention import sliding_window_mask
from megatron_zaya.pretrained import build_single_process_model

BATCH, SEQ = 2, 24
SKIP_BIAS = 0.02  # a skip-class bias that makes the skip class win for about half of the tokens


def grouped_conv_backward_flop(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, _transposed,
                               _output_padding, _groups, output_mask, **kwargs) -> int:
    """Input and weight gradients, each as many products as the forward (w_shape is [C_out, C_in/groups, k])."""
    return sum(output_mask[:2]) * conv_flop_count(x_shape, w_shape, grad_out_shape)


def _counted(recompute: bool = False, backward: bool = False, **overrides):
    """FLOPs FlopCounterMode sees in one pass of the ``test`` model, the config and the measured routed share."""
    extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    cfg = zaya_config("test", use_cpu_initialization=True, params_dtype=torch.float32, skip_bias_init=SKIP_BIAS,
                      moe_token_dispatcher_type="allgather", **extra, **overrides)
    torch.manual_seed(0)
    model = build_single_process_model(cfg).train()  # train mode: the routers count their tokens
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    counter = FlopCounterMode(display=False, custom_mapping={aten.convolution_backward: grouped_conv_backward_flop})
    with sdpa_kernel(SDPBackend.MATH), counter:  # the math backend is made of bmm's, which the counter counts
        out = model(ids, labels=ids)
        if backward:
            out.sum().backward()
    counts = torch.stack([layer.mlp.router.tokens_per_class for layer in model.decoder.layers]).sum(0)
    return counter.get_total_flops(), cfg, routed_fraction(counts, cfg.num_moe_experts)


def padding_positions_flops(cfg) -> float:
    """FLOPs of the depthwise conv outputs that only pad the grouped conv's input: ``cca_time1 - 1`` extra
    positions per sequence and layer (model.cca.causal_qk_conv), which model FLOPs do not count."""
    channels = (cfg.num_attention_heads + cfg.num_query_groups) * cfg.kv_channels
    return BATCH * cfg.num_layers * (cfg.cca_time1 - 1) * 2 * channels * cfg.cca_time0


def test_forward_formula_equals_flop_counter():
    counted, cfg, routed = _counted()
    assert 0.3 < routed < 0.8  # the skip class took part of the tokens
    formula = forward_flops_per_token(cfg, SEQ, routed_fraction=routed, count_masked=True)
    assert sum(formula.values()) * BATCH * SEQ + padding_positions_flops(cfg) == pytest.approx(counted, rel=1e-9)


def test_forward_formula_with_other_conv_sizes_and_sliding_layers():
    counted, cfg, routed = _counted(cca_time0=3, cca_time1=4, sliding_window=5, attention_types=["sliding", "global"])
    formula = forward_flops_per_token(cfg, SEQ, routed_fraction=routed, count_masked=True)
    assert sum(formula.values()) * BATCH * SEQ + padding_positions_flops(cfg) == pytest.approx(counted, rel=1e-9)


@pytest.mark.parametrize("recompute", [False, True])
def test_training_formula_equals_flop_counter_of_forward_and_backward(recompute):
    counted, cfg, routed = _counted(recompute=recompute, backward=True)
    masked_attention = forward_flops_per_token(cfg, SEQ, routed, count_masked=True)["attention"]
    causal_attention = forward_flops_per_token(cfg, SEQ, routed)["attention"]
    formula = training_flops_per_token(cfg, SEQ, routed_fraction=routed, recompute=recompute)
    # Swap the causal attention term for the full S×S one that the counter sees (3 or 4 passes of it).
    formula["attention"] += (3 + recompute) * (masked_attention - causal_attention)
    padding = (3 + recompute) * padding_positions_flops(cfg)
    assert sum(formula.values()) * BATCH * SEQ + padding == pytest.approx(counted, rel=1e-9)


@pytest.mark.parametrize("seq, window", [(1, None), (7, None), (4096, None), (10, 3), (10, 10), (10, 1), (9, 20)])
def test_keys_per_query_counts_the_pairs_the_mask_lets_through(seq, window):
    visible = sliding_window_mask(seq, seq, window if window else seq, torch.device("cpu")).sum().item()
    assert keys_per_query(seq, window) * seq == pytest.approx(visible, rel=1e-12)
    assert keys_per_query(seq, window, count_masked=True) == seq


def test_gqa_baseline_formula_equals_flop_counter_of_megatron_gpt_moe():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_zaya.runtime import ensure_single_process_parallel_state

    ensure_single_process_parallel_state()
    model_parallel_cuda_manual_seed(0)  # Megatron's attention dropout forks this RNG state even at p = 0
    shape = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16)
    cfg = TransformerConfig(**shape, ffn_hidden_size=96, num_moe_experts=4, moe_ffn_hidden_size=96,
                            moe_router_topk=1, moe_router_pre_softmax=True, moe_token_dispatcher_type="allgather",
                            moe_router_load_balancing_type="none", gated_linear_unit=True,
                            activation_func=torch.nn.functional.silu, normalization="RMSNorm",
                            add_bias_linear=False, use_cpu_initialization=True, hidden_dropout=0.0,
                            attention_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False,
                            apply_rope_fusion=False, gradient_accumulation_fusion=False)
    model = GPTModel(cfg, get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm"),
                     vocab_size=512, max_sequence_length=SEQ, position_embedding_type="rope", rotary_percent=0.5)
    ids = torch.randint(0, 512, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    counter = FlopCounterMode(display=False)
    with counter:  # Megatron's local attention: baddbmm + bmm over all S×S pairs
        model(ids, positions, None, labels=ids)
    formula = gqa_moe_forward_flops_per_token(**shape, num_experts=4, moe_ffn_hidden_size=96, topk=1,
                                              vocab_size=512, seq_length=SEQ)
    causal, full = keys_per_query(SEQ), keys_per_query(SEQ, count_masked=True)
    formula["attention"] *= full / causal
    assert sum(formula.values()) * BATCH * SEQ == pytest.approx(counter.get_total_flops(), rel=1e-9)


def test_routed_fraction_ignores_the_skip_class():
    assert routed_fraction([3, 1, 0, 0, 4], num_experts=4) == pytest.approx(0.5)
    assert routed_fraction([2, 2], num_experts=2) == 1.0
