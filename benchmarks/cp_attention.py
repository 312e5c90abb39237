"""Context-parallel CCA attention on one GPU: what each CP rank's attention costs against the whole sequence.

    python -m benchmarks.cp_attention [--seq 32768] [--cp 2]

Times forward+backward of ``SDPAttention.attend`` (ZAYA1-8B's 8 query / 2 KV heads of 128, bf16):
the whole causal sequence on one GPU, then, for each CP rank, its two zig-zag chunks against the keys up to
their ends (the lower-right causal mask of the CP path), with the KV heads shared (GQA) and expanded to the
query heads. Also says whether the flash backend accepts each call. The ideal per-rank time is whole / cp.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_zaya.config import zaya_config
from megatron_zaya.model.core_attention import SDPAttention

from .timing import call_times


def timed(fn, repeats: int = 5) -> float:
    """Mean milliseconds of ``fn()`` after one warm-up call."""
    return statistics.mean(call_times(fn, warmup=1, iters=repeats))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--cp", type=int, default=2)
    args = parser.parse_args()
    config = zaya_config("zaya1-8b", num_layers=1, params_dtype=torch.bfloat16)
    attention = SDPAttention(config, layer_number=1, softmax_scale=128**-0.5)
    heads, kv_heads, d, seq, chunk = 8, 2, 128, args.seq, args.seq // (2 * args.cp)
    q = torch.randn(1, heads, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, kv_heads, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)

    def step(queries, keys, values):
        def run():
            attention.attend(queries, keys, values).sum().backward()
        return run

    def flash_ok(queries, keys, values) -> bool:
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                step(queries, keys, values)()
            return True
        except RuntimeError:
            return False

    whole = timed(step(q, k, v))
    print(f"whole sequence {seq}: {whole:.2f} ms fwd+bwd (flash: {flash_ok(q, k, v)}); ideal per CP rank "
          f"{whole / args.cp:.2f} ms")
    for expand in (False, True):
        keys = k.repeat_interleave(heads // kv_heads, dim=1) if expand else k
        values = v.repeat_interleave(heads // kv_heads, dim=1) if expand else v
        for rank in range(args.cp):
            calls = []
            for chunk_id in (rank, 2 * args.cp - 1 - rank):
                end = (chunk_id + 1) * chunk
                calls.append((q[:, :, end - chunk:end], keys[:, :, :end], values[:, :, :end]))
            total = sum(timed(step(*call)) for call in calls)
            flash = all(flash_ok(*call) for call in calls)
            print(f"CP rank {rank}, KV heads {'expanded' if expand else 'shared (GQA)'}: {total:.2f} ms "
                  f"({total / (whole / args.cp):.2f}x ideal; flash: {flash})")


if __name__ == "__main__":
    main()
