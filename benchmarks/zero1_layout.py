"""ZeRO-1 layout of ``--optimizer zaya_muon --use-distributed-optimizer`` for a preset, without building weights.

    python -m benchmarks.zero1_layout                          # zaya1-8b at DP 1, 2, 4, 8 (CPU, about a minute)
    python -m benchmarks.zero1_layout --preset test --dp 1,2,4 --bucket-size 4000

Builds the model on the meta device, lays out DDP's buffers as ``optim.zero`` does (Megatron's default bucket
size, ``max(4e7, 1e6 · DP)`` elements, unless given) and prints per data-parallel size: the buffer padding (it
costs bf16 weight + gradient bytes on every rank), the busiest rank's Newton–Schulz FLOPs and Muon state (fp32
master + momentum) against an even split, and the resulting bytes per parameter between steps on that rank.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="zaya1-8b")
    parser.add_argument("--dp", default="1,2,4,8", help="comma-separated data-parallel sizes")
    parser.add_argument("--bucket-size", type=int, default=None)
    parser.add_argument("--grad-reduce-in-bf16", action="store_true", help="bf16 gradient buffers (2 B, not 4)")
    args = parser.parse_args()

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_zaya.config import zaya_config
    from megatron_zaya.model import build_zaya_model
    from megatron_zaya.optim import zero
    from megatron_zaya.patches import apply_patches

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as sock:  # any free port: the process group has one rank
        sock.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(sock.getsockname()[1]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    apply_patches("cpu")
    model_parallel_cuda_manual_seed(0)
    with torch.device("meta"):
        model = build_zaya_model(zaya_config(args.preset, params_dtype=torch.bfloat16, bf16=True,
                                             use_cpu_initialization=True, perform_initialization=False,
                                             moe_token_dispatcher_type="allgather"))  # fmt: skip
    assert all(p.is_meta for p in model.parameters()), "the model must not allocate its weights"
    zero.tag_muon_params([model])
    params = [p for p in model.parameters() if p.requires_grad]
    matrices = [p for p in params if p.is_managed_by_layer_wise_optimizer]
    flops = dict(zip(matrices, zero.newton_schulz_flops(matrices)))
    total, muon = sum(p.numel() for p in params), sum(p.numel() for p in matrices)
    grad_bytes = 2 if args.grad_reduce_in_bf16 else 4
    print(f"{args.preset}: {total / 1e6:.2f}M parameters, {muon / 1e6:.2f}M in Muon matrices, "
          f"{(total - muon) / 1e6:.2f}M AdamW")  # fmt: skip
    print("DP  buffer padding  NS FLOPs max/even  Muon state max/even  bytes/param between steps (busiest rank)")
    for dp in (int(n) for n in args.dp.split(",")):
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=not args.grad_reduce_in_bf16,
                                                   use_distributed_optimizer=True)  # fmt: skip
        bucket = args.bucket_size or max(40_000_000, 1_000_000 * dp)
        layout = zero.compute_full_param_layout(params, bucket, dp, ddp_config, dp)
        buffer = sum(per.bucket_indices[-1][1] for per in layout.layouts.values() if per.bucket_indices)
        owners = zero.owners([argparse.Namespace(full_param_layout=layout)])
        load, state = [0.0] * dp, [0] * dp
        for param, owner in owners.items():
            load[owner] += flops[param]
            state[owner] += param.numel()
        busiest = ((2 + grad_bytes) * buffer + 8 * max(state) + 12 * (total - muon) / dp) / total
        print(f"{dp:<3d} {100 * (buffer - total) / total:13.2f}%  {max(load) / (sum(load) / dp):17.3f}  "
              f"{max(state) / (sum(state) / dp):19.3f}  {busiest:6.2f} (model: {2 + grad_bytes} + "
              f"{(8 * muon + 12 * (total - muon)) / total / dp:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
