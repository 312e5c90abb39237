"""In-process timings for ``benchmarks.throughput`` (each part in its own process, JSON to --out).

    python -m benchmarks.inprocess eager --out DIR [--smoke]   # one decoder layer: transformers eager vs ours
    python -m benchmarks.inprocess sweep --out DIR [--smoke]   # tokens/s vs sequence length: ZAYA1 vs GQA

``eager``: forward + backward of ONE decoder layer at S = 4096, B = 2 (bf16 weights, the fp32 residual stream
as input): ``transformers``' ``ZayaDecoderLayer`` with eager attention and experts (the public reference)
and our ``ZayaTransformerLayer`` (with the kernels that apply on the device), same shapes, CUDA-event timing;
on GPUs also ours replayed as CUDA graphs (``model/cuda_graphs.py``, what ``--zaya-cuda-graphs`` runs).

``sweep``: whole training steps (forward + backward of every micro-batch, then an AdamW step) of ZAYA1 and of
Megatron-Core's GPT-MoE with GQA attention on SDPA (benchmarks/gqa_sdpa.py) at the same width, heads,
experts and vocabulary, for each sequence length, at a constant number of tokens per step (micro-batches of
at most 8,192 tokens, as in the CLI runs). Both use the same plain ``torch.optim.AdamW`` on bf16 parameters
(no Megatron DDP or fp32 master weights), so the absolute rates sit above the CLI's; the ratio is the point.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
from pathlib import Path

import torch

from megatron_zaya.config import zaya_config
from megatron_zaya.flops import (gqa_moe_forward_flops_per_token, routed_fraction,
                                 training_flops_per_token)

from .timing import call_times

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16 if GPU else torch.float32
MICRO_BATCH_TOKENS = 8192 if GPU else 64


def zaya_cfg(smoke: bool, layers: int, seq: int, **overrides):
    return zaya_config("tiny" if smoke else "zaya1-8b-shallow", num_layers=layers, max_position_embeddings=seq,
                       params_dtype=DTYPE, bf16=GPU, use_cpu_initialization=not GPU,
                       moe_token_dispatcher_type="alltoall", **overrides)


def setup_single_process():
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_zaya.runtime import ensure_single_process_parallel_state

    ensure_single_process_parallel_state()
    model_parallel_cuda_manual_seed(1234)  # Megatron initialises weights on the GPU under this RNG state


# ------------------------------------------------------------------------------------------------- eager
def hf_layer(cfg):
    """transformers' ZAYA1 decoder layer 0 for ``cfg``, eager attention, random weights."""
    from transformers import ZayaConfig as HFZayaConfig
    from transformers.models.zaya.modeling_zaya import ZayaDecoderLayer, ZayaRotaryEmbedding

    from megatron_zaya.convert.hf import hf_config_from_zaya

    hf = HFZayaConfig(**hf_config_from_zaya(cfg), attn_implementation="eager", experts_implementation="eager")
    torch.manual_seed(0)
    layer = ZayaDecoderLayer(hf, layer_idx=0)
    with torch.no_grad():
        for param in layer.parameters():  # the experts are torch.empty until a model's init runs
            if param.dim() > 1:
                param.normal_(0.0, 0.02)
    return layer.to(DEVICE, DTYPE).train(), ZayaRotaryEmbedding(hf).to(DEVICE)


def eager(args) -> dict:
    seq, batch = (64, 2) if args.smoke else (4096, 2)
    cfg = zaya_cfg(args.smoke, 1, seq)
    warmup, iters = (1, 2) if args.smoke else (2, 5)
    hidden = torch.randn(batch, seq, cfg.hidden_size, device=DEVICE)  # the fp32 residual stream
    grad = torch.randn_like(hidden)

    layer, rope = hf_layer(cfg)
    positions = torch.arange(seq, device=DEVICE)[None]
    cos_sin = rope(hidden.to(DTYPE), positions, "hybrid")
    causal = torch.full((seq, seq), torch.finfo(DTYPE).min, device=DEVICE, dtype=DTYPE).triu(1)[None, None]
    x_hf = hidden.clone().requires_grad_()

    def hf_step():
        out, _ = layer(x_hf, None, attention_mask={"causal": causal, "conv": None}, position_embeddings=cos_sin)
        out.backward(grad)

    hf_ms = call_times(hf_step, warmup, iters)
    del layer, causal
    gc.collect()

    setup_single_process()
    from megatron_zaya.pretrained import build_single_process_model

    model = build_single_process_model(cfg).to(DEVICE).train()
    ours = model.decoder.layers[0]
    rotary = model.rotary_pos_emb["global"](seq)
    x_ours = hidden.transpose(0, 1).contiguous().requires_grad_()  # Megatron's [s, b, h]
    grad_ours = grad.transpose(0, 1).contiguous()

    def our_step():
        out, _ = ours(x_ours, rotary_pos_emb=rotary)
        out.backward(grad_ours)

    our_ms = call_times(our_step, warmup, iters)
    result = {"seq": seq, "batch": batch, "transformers_eager_ms": statistics.median(hf_ms),
              "ours_ms": statistics.median(our_ms), "transformers_eager_all_ms": hf_ms, "ours_all_ms": our_ms}
    result["layer_speedup"] = result["transformers_eager_ms"] / result["ours_ms"]
    if GPU:  # the same layer replayed as CUDA graphs (--zaya-cuda-graphs)
        from megatron_zaya.model.cuda_graphs import LayerGraphs

        graphs = LayerGraphs([ours])

        def graphed_step():
            out, _ = graphs(x_ours, None, None, {"global": rotary})
            out.backward(grad_ours)

        graphed_ms = call_times(graphed_step, warmup, iters)
        result.update(ours_graphed_ms=statistics.median(graphed_ms), ours_graphed_all_ms=graphed_ms,
                      graphed_layer_speedup=result["transformers_eager_ms"] / statistics.median(graphed_ms))
    return result


# ------------------------------------------------------------------------------------------------- sweep
def gqa_model(cfg):
    """Megatron GPT-MoE with GQA (SDPA) at the width, heads, experts and vocabulary of ZAYA1 config ``cfg``."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from .gqa_sdpa import gqa_sdpa_block_spec

    tc = TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups, kv_channels=cfg.kv_channels, ffn_hidden_size=cfg.ffn_hidden_size,
        num_moe_experts=cfg.num_moe_experts, moe_ffn_hidden_size=cfg.moe_ffn_hidden_size, moe_router_topk=1,
        moe_router_pre_softmax=True, moe_router_load_balancing_type="none", moe_token_dispatcher_type="alltoall",
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, params_dtype=DTYPE, bf16=GPU,
        use_cpu_initialization=not GPU,
    )
    model = GPTModel(tc, gqa_sdpa_block_spec(tc), vocab_size=cfg.vocab_size,
                     max_sequence_length=cfg.max_position_embeddings, position_embedding_type="rope",
                     rotary_percent=cfg.rotary_percent, rotary_base=int(cfg.rotary_base))
    return model.to(DEVICE, DTYPE)


def run_point(model, kind: str, seq: int, tokens_per_step: int, steps: int) -> dict:
    mbs = max(1, MICRO_BATCH_TOKENS // seq)
    micro_batches = max(1, tokens_per_step // (mbs * seq))
    vocab = model.vocab_size
    ids = torch.randint(0, vocab, (micro_batches, mbs, seq + 1), device=DEVICE)
    positions = torch.arange(seq, device=DEVICE).expand(mbs, seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=GPU)

    def step():
        for tokens in ids:
            inputs, labels = tokens[:, :-1], tokens[:, 1:]
            if kind == "zaya":
                loss = model(inputs, labels=labels)
            else:
                loss = model(inputs, positions, None, labels=labels)
            (loss.float().sum() / loss.numel()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if GPU:
        torch.cuda.reset_peak_memory_stats()
    ms = call_times(step, warmup=1, iters=steps)
    tokens = micro_batches * mbs * seq
    point = {"seq": seq, "micro_batch": mbs, "micro_batches": micro_batches, "tokens_per_step": tokens,
             "ms_per_step": statistics.median(ms), "all_ms": ms}
    point["tokens_per_s"] = tokens / point["ms_per_step"] * 1e3
    if GPU:
        point["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del optimizer
    return point


def sweep(args) -> dict:
    setup_single_process()
    from megatron_zaya.model.router import ZayaRouter
    from megatron_zaya.pretrained import build_single_process_model

    seqs = [32, 64, 128, 256] if args.smoke else [4096, 8192, 16384, 32768]
    tokens_per_step = 256 if args.smoke else 32768
    steps = 1 if args.smoke else 2
    cfg = zaya_cfg(args.smoke, args.layers, max(seqs))
    results = {"layers": args.layers, "optimizer": "torch.optim.AdamW on bf16 parameters", "zaya": [], "gqa": []}
    for kind in ("zaya", "gqa"):
        torch.manual_seed(0)
        model = (build_single_process_model(cfg) if kind == "zaya" else gqa_model(cfg)).to(DEVICE).train()
        routers = [m for m in model.modules() if isinstance(m, ZayaRouter)]
        for seq in seqs:
            for router in routers:
                router.tokens_per_class.zero_()
            try:
                point = run_point(model, kind, seq, tokens_per_step, steps)
            except torch.OutOfMemoryError:
                point = {"seq": seq, "error": "out of memory"}
            if "error" not in point:
                if kind == "zaya":
                    counts = torch.stack([r.tokens_per_class for r in routers]).sum(0)
                    point["routed_fraction"] = routed_fraction(counts, cfg.num_moe_experts)
                    flops = sum(training_flops_per_token(cfg, seq, point["routed_fraction"]).values())
                else:
                    flops = 3 * sum(gqa_moe_forward_flops_per_token(
                        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
                        kv_channels=cfg.kv_channels, num_experts=cfg.num_moe_experts,
                        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size, topk=1, vocab_size=cfg.vocab_size,
                        seq_length=seq).values())
                point["tflops_per_s"] = point["tokens_per_s"] * flops / 1e12
            print(f"[sweep] {kind} seq {seq}: {point}", flush=True)
            results[kind].append(point)
            gc.collect()
            if GPU:
                torch.cuda.empty_cache()
        del model, routers
        gc.collect()
        if GPU:
            torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("eager", "sweep"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device")
    args = parser.parse_args()
    result = eager(args) if args.part == "eager" else sweep(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.part}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
