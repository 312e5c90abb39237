"""CCA with packed documents against one causal sequence of the same tokens.

    python -m benchmarks.packed_documents                          # S=4096 B=2 and S=32768 B=1, one GPU
    python -m benchmarks.packed_documents --points 256x1 --smoke   # tiny widths on any device: checks the script

Times forward + backward (median of ``--rounds`` × ``--iters`` steps after warm-up, the variants taking turns
round by round) of layer 0's ``self_attention`` of a ZAYA1-8B-width model built as training builds it (with its
kernels on GPUs), in bf16 on ``[S, B, 2048]``:

* ``causal``: one causal sequence per row (no position ids: the model's plain path);
* ``packed``: the same tokens as documents whose lengths are drawn from a log-normal of median
  ``--median-document`` tokens (web text is long-tailed), each row packed differently: attention, the convolutions
  and the value delay stay within documents, RoPE restarts (``megatron_zaya/model/documents.py``).

Prints both times and causal / packed (the target: >= 1 at S=4096 and S=32768).
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch

from .inprocess import DEVICE, DTYPE, GPU, setup_single_process, zaya_cfg
from .timing import call_times


def document_positions(seq: int, batch: int, median: int, generator: torch.Generator) -> torch.Tensor:
    """Position ids ``[batch, seq]`` that restart at 0 at every document start."""
    rows = []
    for _ in range(batch):
        lengths, total = [], 0
        while total < seq:
            length = max(1, int(torch.empty(1).log_normal_(mean=float(torch.tensor(median).log()), std=1.0,
                                                           generator=generator).item()))
            lengths.append(min(length, seq - total))
            total += lengths[-1]
        rows.append(torch.cat([torch.arange(n) for n in lengths]))
    return torch.stack(rows)


def step(block, x, kwargs) -> None:
    out, _ = block(x, **kwargs)
    out.float().square().mean().backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", default="4096x2,32768x1", help="comma-separated SEQxBATCH")
    parser.add_argument("--median-document", type=int, default=600, help="median document length in tokens")
    parser.add_argument("--iters", type=int, default=10, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the variants in turn")
    parser.add_argument("--smoke", action="store_true", help="tiny widths on any device")
    args = parser.parse_args()
    if args.iters < 1 or args.rounds < 1:
        parser.error(f"--iters {args.iters} --rounds {args.rounds}: both must be at least 1")
    if not GPU and not args.smoke:
        raise SystemExit("packed_documents.py needs a CUDA or ROCm GPU; use --smoke to check the script on CPU")

    from megatron_zaya.model.documents import rotary_table
    from megatron_zaya.pretrained import build_single_process_model

    setup_single_process()  # also applies the patches (kernels on GPUs)
    generator = torch.Generator().manual_seed(0)
    for point in args.points.split(","):
        seq, batch = (int(n) for n in point.split("x"))
        cfg = zaya_cfg(args.smoke, 1, seq)
        model = build_single_process_model(cfg).to(DEVICE).train()
        block, rope = model.decoder.layers[0].self_attention, model.rotary_pos_emb["global"]
        x = torch.randn(seq, batch, cfg.hidden_size, device=DEVICE, dtype=DTYPE, requires_grad=True)
        positions = document_positions(seq, batch, args.median_document, generator).to(DEVICE)
        documents = int((positions == 0).sum())
        runs = {"causal": dict(attention_mask=None, rotary_pos_emb=rope(seq)),
                "packed": dict(attention_mask=positions.t().contiguous(),
                               rotary_pos_emb=rotary_table(rope.inv_freq, positions))}
        steps = {name: partial(step, block, x, kwargs) for name, kwargs in runs.items()}
        times = {name: [] for name in runs}
        for round_ in range(args.rounds):  # alternating, so that the machine's drift reaches both alike
            for name, fn in steps.items():
                times[name] += call_times(fn, warmup=2 if round_ == 0 else 0, iters=args.iters)
        times = {name: statistics.median(ms) for name, ms in times.items()}
        print(f"S={seq} B={batch} documents={documents}: causal {times['causal']:.2f} ms, packed "
              f"{times['packed']:.2f} ms, causal/packed {times['causal'] / times['packed']:.2f}")


if __name__ == "__main__":
    main()
