"""The host's own work in one ZAYA1 layer's training step as trained, on a CPU: a proxy for the eager layer's host
time where no GPU is at hand.

    python -m benchmarks.layer_host_cpu                            # this tree: ms per layer step
    python -m benchmarks.layer_host_cpu --baseline /tmp/base       # and another package, in alternating rounds

The test model's layer as the CLI trains it on a GPU (every kernel op, Megatron's DDP adding gradients into
``main_grad``, the default selective recomputation) runs on CPU tensors of the test model's width, with every
Triton launch replaced by a no-op: what is timed is the Python of the ops and their wrappers, autograd, Megatron's
code and torch's dispatch, plus the torch ops' CPU work on tiny tensors. A GPU adds each launch's driver time
and the kernels' own time, which this leaves out (``profile_layer`` measures them). The kernels' outputs stay
unwritten; the sort by expert's are filled with a valid order (every token to expert 0), which the grouped GEMM
checks on CPU. Each round is a fresh process (``--baseline``: the other package's, next), timing the median of
``--steps`` steps after three warm-up steps.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

KERNEL_MODULES = ("cca", "cross_entropy", "grouped_gemm", "newton_schulz", "residual_rmsnorm", "router",
                  "sort_by_expert", "swiglu")


def _stub_launches(launches: list[int]) -> None:
    """Every kernel module's ``launch`` counts the launch and runs nothing; the kernels run on CPU tensors."""
    import torch

    def launch(kernel, grid, *args, **kwargs):
        launches[0] += 1
        if kernel.__name__ == "_sort_by_expert_kernel":
            named = dict(zip(kernel.arg_names, args))
            tokens = named["n_tokens"]
            named["counts_ptr"].zero_()[0] = tokens
            named["order_ptr"].copy_(torch.arange(tokens))
            named["inverse_ptr"].copy_(torch.arange(tokens))

    for name in KERNEL_MODULES:
        module = importlib.import_module(f"megatron_zaya.kernels.{name}")
        module.launch = launch
        module.triton_runs = lambda kernel, *tensors: True


def measure(steps: int) -> dict:
    """This process's package: ms per layer step (median of ``steps``) and Triton launches per step."""
    import torch

    torch.set_num_threads(1)
    launches = [0]
    _stub_launches(launches)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_zaya.config import KERNEL_OPS, zaya_config
    from megatron_zaya.pretrained import build_single_process_model

    cfg = zaya_config("test", num_layers=1, kernels=",".join(KERNEL_OPS), use_cpu_initialization=True,
                      params_dtype=torch.float32, recompute_granularity="selective")
    model = build_single_process_model(cfg).train()
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    layer, seq = model.decoder.layers[0], 32
    rotary = model.rotary_pos_emb["global"](seq)
    x = torch.randn(seq, 2, cfg.hidden_size, requires_grad=True)
    grad = torch.ones_like(x)

    def step():
        out, _ = layer(x, rotary_pos_emb=rotary)
        out.backward(grad)

    for _ in range(3):
        step()
    launches[0], times = 0, []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    assert ddp is not None  # its gradient hooks live as long as it does
    return {"ms": 1e3 * statistics.median(times), "launches": launches[0] / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="another version's package directory (holding megatron_zaya)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a round: this process, as JSON
    args = parser.parse_args()
    if args.one:
        import megatron_zaya

        print(json.dumps({**measure(args.steps), "package": str(Path(megatron_zaya.__file__).parents[1])}))
        return
    trees = {"this tree": str(Path(__file__).resolve().parents[1])}
    if args.baseline:
        trees["baseline"] = str(Path(args.baseline).resolve())
    results: dict[str, list[dict]] = {name: [] for name in trees}
    for round_ in range(args.rounds):
        for name, tree in trees.items():
            # this file run in the tree's directory, which comes first on the path: that tree's megatron_zaya
            code = f"import runpy; runpy.run_path({__file__!r}, run_name='__main__')"
            out = subprocess.run([sys.executable, "-c", code, "--one", "--steps", str(args.steps)], cwd=tree,
                                 env={**os.environ, "TORCH_COMPILE_DISABLE": "1"}, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"{name}: {out.stderr[-3000:]}")
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            assert results[name][-1]["package"] == tree, (name, results[name][-1])
            print(f"round {round_ + 1}, {name}: {results[name][-1]['ms']:.3f} ms per layer step, "
                  f"{results[name][-1]['launches']:.0f} Triton launches", flush=True)
    medians = {name: statistics.median(r["ms"] for r in rounds) for name, rounds in results.items()}
    print("median of rounds: " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in medians.items())
          + (f"; this tree / baseline {medians['this tree'] / medians['baseline']:.2f}" if args.baseline else ""))


if __name__ == "__main__":
    main()
