"""ZAYA1's CCA attention block against 16-head MHA at the same hidden size (the CCA paper's speed claim).

    python -m benchmarks.cca_vs_mha                          # S=4096 B=2 and S=16384 B=1, one GPU
    python -m benchmarks.cca_vs_mha --points 8192x1 --smoke  # tiny widths on any device: checks the script

Times forward + backward (median of ``--iters`` after warm-up) of

* ``cca``: ``self_attention`` of layer 0 of a ZAYA1-8B-width model built as training builds it (megatron-zaya's
  kernel patches applied on GPUs): q/k/v projections, the causal convolutions, QK-norm with key temperature and
  partial RoPE, the value delay, SDPA over 8 query / 2 KV heads of 128, and the output projection;
* ``mha``: the usual block at the same hidden size, 16 heads of 128: one fused qkv projection, causal SDPA
  (flash on GPUs) and the output projection;

both in bf16 on ``[S, B, 2048]`` inputs, and prints mha / cca (the CCA paper's claim: ≥ 1.3× at S=4096 and
≥ 1.7× at S=16384). On GPUs both blocks are timed a second time as CUDA-graph replays
(``torch.cuda.make_graphed_callables``, forward and backward), which takes the host's launch time out of both.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from .inprocess import DEVICE, DTYPE, GPU, setup_single_process, zaya_cfg
from .timing import call_times


class MultiHeadAttentionBlock(torch.nn.Module):
    """qkv projection, causal SDPA, output projection: the baseline block."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [s, b, h]
        s, b, h = x.shape
        q, k, v = self.qkv(x).view(s, b, 3, self.heads, h // self.heads).permute(2, 1, 3, 0, 4)  # [b, n, s, d]
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(context.permute(2, 0, 1, 3).reshape(s, b, h))


def cca_block(smoke: bool, seq: int):
    """Layer 0's CCA module of a one-layer model, and its rotary embedding for ``seq`` positions."""
    from megatron_zaya.pretrained import build_single_process_model

    setup_single_process()  # also applies the patches (kernels on GPUs)
    cfg = zaya_cfg(smoke, 1, seq)
    model = build_single_process_model(cfg).to(DEVICE).train()
    return model.decoder.layers[0].self_attention, model.rotary_pos_emb["global"](seq), cfg


class OneTensorCall(torch.nn.Module):
    """``block(x, **kwargs)`` (its first output) as a one-tensor module, the form ``make_graphed_callables`` takes;
    a fresh wrapper per shape, so that each capture sees the block's own forward."""

    def __init__(self, block, **kwargs):
        super().__init__()
        self.block, self.kwargs = block, kwargs

    def forward(self, x):
        out = self.block(x, **self.kwargs)
        return out[0] if isinstance(out, tuple) else out


def fwd_bwd_ms(step, iters: int) -> float:
    return statistics.median(call_times(step, warmup=2, iters=iters))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", default="4096x2,16384x1", help="comma-separated SEQxBATCH")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="tiny widths on any device")
    args = parser.parse_args()
    if not GPU and not args.smoke:
        raise SystemExit("cca_vs_mha.py needs a CUDA or ROCm GPU; use --smoke to check the script on CPU")
    points = [tuple(int(n) for n in p.split("x")) for p in args.points.split(",")]
    cca, rotary, cfg = cca_block(args.smoke, max(seq for seq, _ in points))
    mha_heads = cfg.hidden_size // cfg.kv_channels
    mha = MultiHeadAttentionBlock(cfg.hidden_size, mha_heads).to(DEVICE, DTYPE)
    print(f"device {torch.cuda.get_device_name() if GPU else 'cpu'}; torch {torch.__version__}; hidden "
          f"{cfg.hidden_size}; CCA {cfg.num_attention_heads}/{cfg.num_query_groups} heads of {cfg.kv_channels}; "
          f"MHA {mha_heads} heads; {DTYPE}")
    print(f"{'seq':>6s} {'batch':>5s} {'cca ms':>9s} {'mha ms':>9s} {'mha/cca':>8s}"
          + (f" {'cca graph':>9s} {'mha graph':>9s} {'mha/cca':>8s}" if GPU else ""))
    for seq, batch in points:
        x = torch.randn(seq, batch, cfg.hidden_size, device=DEVICE, dtype=DTYPE, requires_grad=True)
        grad = torch.randn_like(x)

        def cca_step():
            out, _ = cca(x, rotary_pos_emb=rotary[:seq])
            out.backward(grad)

        def mha_step():
            mha(x).backward(grad)

        ours, baseline = fwd_bwd_ms(cca_step, args.iters), fwd_bwd_ms(mha_step, args.iters)
        line = f"{seq:6d} {batch:5d} {ours:9.3f} {baseline:9.3f} {baseline / ours:7.2f}x"
        if GPU:
            # one capture per block (each its own memory pool: they are replayed one after the other)
            graphed = [torch.cuda.make_graphed_callables(block, (x,))
                       for block in (OneTensorCall(cca, rotary_pos_emb=rotary[:seq]), OneTensorCall(mha))]
            steps = [lambda block=block: block(x).backward(grad) for block in graphed]
            ours, baseline = (fwd_bwd_ms(step, args.iters) for step in steps)
            line += f" {ours:9.3f} {baseline:9.3f} {baseline / ours:7.2f}x"
        print(line)
        del x, grad
        if GPU:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
