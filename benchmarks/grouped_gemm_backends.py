"""Time the experts' grouped GEMMs on both backends, GEMM by GEMM, and write the faster into the model's table.

    python -m benchmarks.grouped_gemm_backends            # CUDA or ROCm GPU, about a minute: prints the timings
    python -m benchmarks.grouped_gemm_backends --write    # and writes them into megatron_zaya/ops/grouped_mm_table.json
    TRITON_INTERPRET=1 python -m benchmarks.grouped_gemm_backends --smoke   # tiny shapes on CPU: the script runs

The experts of ``--preset`` (zaya1-8b: 16 experts, hidden 2048, FFN 2048, so fc1 [16, 4096, 2048] and fc2
[16, 2048, 2048]) in bf16, at ``--tokens`` rows (16,384: sequence 4096 at micro-batch 4, as ZAYA1-8B trains on
one H200), of which one in 17 belongs to no expert (the skip class's share under uniform routing: the padded tail
of the model's dispatch) and the rest are routed uniformly at random with expert 0 idle. Each GEMM of a grouped
GEMM call is timed alone, on the Triton kernel (``kernels/grouped_gemm.py``) and on ``torch._grouped_mm``
(``ops/grouped_mm.py``), median of ``triton.testing.do_bench``:

- ``forward``: out = x @ weight[e].T; ``input_grad``: d x = d out @ weight[e];
- ``weight_grad`` as trained: d weight[e] = d out[rows of e].T @ x[rows of e] added into each expert's fp32
  ``main_grad`` (the kernel in fp32; torch's GEMM in bf16, then one foreach addition).

The weights and their ``main_grad``s sit as Megatron's DDP buffers hold them: one buffer each, the experts in
reverse order. ``torch._grouped_mm`` needs them at one forward stride, so it reads a stacked copy, which is timed
with it. With ``--write`` the faster backend of each GEMM (Triton on a tie) replaces this GPU's entries for these
shapes in the table, with the timings, GPU, torch and Triton versions, the command and the date; the model reads
the table when it is built.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from importlib.metadata import version
from pathlib import Path

import torch

from megatron_zaya.config import zaya_config
from megatron_zaya.ops import grouped_mm

from .timing import gpu_or_smoke


def weight_shapes(config) -> dict[str, tuple[int, int, int]]:
    """The experts' stacked weight shapes [E, M, K]: fc1 [E, 2F, D] (gate and up rows), fc2 [E, D, F]."""
    experts, hidden, ffn = config.num_moe_experts, config.hidden_size, config.moe_ffn_hidden_size
    return {"fc1": (experts, 2 * ffn, hidden), "fc2": (experts, hidden, ffn)}


def entries(shapes: dict, time_ms, device: str, dtype: torch.dtype, tokens: int, command: str) -> list[dict]:
    """One table entry per weight shape: ``time_ms(name, shape, gemm, backend)`` for every GEMM and backend, and
    the faster backend of each GEMM (the Triton kernel on a tie)."""
    made = []
    for name, shape in shapes.items():
        ms = {gemm: {backend: round(time_ms(name, shape, gemm, backend), 4) for backend in grouped_mm.BACKENDS}
              for gemm in grouped_mm.GEMMS}  # fmt: skip
        made.append(dict(device=device, dtype=grouped_mm.dtype_name(dtype), weight=list(shape), matrix=name,
                         backends={gemm: min(times, key=times.get) for gemm, times in ms.items()}, ms=ms,
                         tokens=tokens, torch=torch.__version__, triton=version("triton"), command=command,
                         date=datetime.date.today().isoformat()))  # fmt: skip
    return made


def write_table(path: Path, new: list[dict]) -> None:
    """``new`` entries into the table at ``path``, replacing those of the same GPU, dtype and weight shape."""
    table = json.loads(path.read_text())
    replaced = {(e["device"], e["dtype"], tuple(e["weight"])) for e in new}
    kept = [e for e in table["entries"] if (e["device"], e["dtype"], tuple(e["weight"])) not in replaced]
    table["entries"] = sorted(kept + new, key=lambda e: (e["device"], e["dtype"], e["weight"]))
    path.write_text(json.dumps(table, indent=2) + "\n")


class Operands:
    """One weight shape's operands on ``device``: weights and their ``main_grad``s (fp32 unless ``main_grad_dtype``
    says otherwise, bf16 under ``--grad-reduce-in-bf16``) in DDP's layout, inputs, counts."""

    def __init__(self, shape, tokens: int, device: str, dtype: torch.dtype,
                 main_grad_dtype: torch.dtype = torch.float32):
        experts, m_dim, k_dim = shape
        gen = torch.Generator(device).manual_seed(0)
        weights = torch.empty(experts, m_dim, k_dim, device=device, dtype=dtype)
        mains = torch.zeros(experts, m_dim, k_dim, device=device, dtype=main_grad_dtype)
        weights.copy_(0.02 * torch.randn(weights.shape, generator=gen, device=device))
        self.weights = weights.unbind(0)[::-1]  # expert 0 last in memory, as in Megatron's buffers
        for weight, main in zip(self.weights, mains.unbind(0)[::-1]):
            weight.main_grad, weight.grad_added_to_main_grad = main, False
        routed = tokens - tokens // 17
        chosen = torch.randint(1, experts, (routed,), generator=gen, device=device)
        self.counts = torch.bincount(chosen, minlength=experts)
        self.x = torch.randn(tokens, k_dim, generator=gen, device=device).to(dtype)
        self.grad_out = torch.randn(tokens, m_dim, generator=gen, device=device).to(dtype)


def gemm_function(operands: Operands, gemm: str, backend: str):
    """The one GEMM ``gemm`` of a grouped GEMM call on ``backend``, as the model's autograd function runs it."""
    from megatron_zaya.kernels import grouped_gemm as kernel

    x, counts, padded, table, *weights = kernel.prepare(operands.x, operands.weights, operands.counts, True)
    offsets, tail = grouped_mm.row_offsets(counts, x.shape[0], padded)
    grad_out = operands.grad_out
    if backend == "torch":
        return {"forward": lambda: grouped_mm.torch_forward(x, weights, offsets, tail),
                "input_grad": lambda: grouped_mm.torch_input_grad(grad_out, weights, offsets, tail),
                "weight_grad": lambda: grouped_mm.torch_weight_grad(grad_out, x, offsets, weights, True)}[gemm]
    main_grads = kernel.main_grad_target(weights)
    assert main_grads is not None, "the weights have no main_grad to accumulate into"
    return {"forward": lambda: kernel.matmul(x, counts, padded, table, weights, transposed=True),
            "input_grad": lambda: kernel.matmul(grad_out, counts, padded, table, weights, transposed=False),
            "weight_grad": lambda: kernel.weight_grad(grad_out, x, counts, padded, weights, main_grads)}[gemm]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="zaya1-8b", help="the model whose expert shapes are timed")
    parser.add_argument("--tokens", type=int, default=16384, help="rows of x, the padded tail included")
    parser.add_argument("--write", action="store_true", help=f"write the choices into {grouped_mm.TABLE_PATH}")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (the test preset), any device")
    args = parser.parse_args()
    if args.smoke and args.write:
        parser.error("--smoke timings are no measurement: leave out --write")
    device = gpu_or_smoke("grouped_gemm_backends.py", args.smoke)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = weight_shapes(zaya_config("test" if args.smoke else args.preset))
    tokens = 64 if args.smoke else args.tokens
    name = grouped_mm.device_name()
    if not grouped_mm.available(device, dtype):
        raise SystemExit(f"torch {torch.__version__} has no torch._grouped_mm for {name} in {dtype}: the Triton "
                         "kernel is the only backend, nothing to measure")
    print(f"device {name} | torch {torch.__version__} | triton {version('triton')} | {dtype} | tokens {tokens}")
    operands = {n: Operands(shape, tokens, device, dtype) for n, shape in shapes.items()}

    from .bench_kernels import median_ms  # imports the kernels (triton): here, not when the table is tested

    def time_ms(matrix, shape, gemm, backend):
        ms = median_ms(gemm_function(operands[matrix], gemm, backend), device)
        print(f"{matrix} {list(shape)} {gemm:12s} {backend:7s} {ms:8.3f} ms", flush=True)
        return ms

    command = " ".join(["python -m benchmarks.grouped_gemm_backends", *sys.argv[1:]])
    made = entries(shapes, time_ms, name, dtype, tokens, command)
    for entry in made:
        print(f"{entry['matrix']} {entry['weight']}: {entry['backends']}")
    if args.write:
        write_table(grouped_mm.TABLE_PATH, made)
        print(f"written: {grouped_mm.TABLE_PATH}")


if __name__ == "__main__":
    main()
