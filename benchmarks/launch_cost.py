"""Host time of one launch on this machine: torch ops against our Triton kernels' wrappers, on tensors so small that
the device is never the bottleneck (the host's time per call is the wall time per call)::

    python -m benchmarks.launch_cost            # CUDA or ROCm GPU, a few seconds
    python -m benchmarks.launch_cost --key      # any device: the cached launch's Python before the launcher

Each figure is the best of 7 rounds of 400 calls, in microseconds per call; our wrappers' with the launches
through ``kernels.launch``'s cached launcher (``direct``), the same launcher given tensors rather than their
addresses (``tensors``, which it then reads and checks one by one), and ``kernel[grid](...)`` (``Triton path``).
"""

from __future__ import annotations

import argparse
import contextlib
import time
import timeit

import torch
import triton
import triton.language as tl

from megatron_zaya.kernels import launch, residual_rmsnorm, router


def per_call_us(fn, calls: int = 400, rounds: int = 7) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
        torch.cuda.synchronize()
    return best * 1e6


@contextlib.contextmanager
def tensors_to_the_launcher():
    """Within: ``kernels.launch`` passes its cached launcher the tensors themselves, not their device addresses."""
    own = launch.key_and_arguments
    launch.key_and_arguments = lambda plan, values, options: (own(plan, list(values), options)[0], values)
    try:
        yield
    finally:
        launch.key_and_arguments = own


@triton.jit
def _seventeen_arguments(a, b, c, d, e, f, g, h, n, m, s1, s2, s3, s4, s5, s6, eps, BLOCK: tl.constexpr,
                         WIDTH: tl.constexpr):
    pass


def key_us() -> float:
    """Microseconds per call of what ``kernels.launch`` does in Python before its launcher (binding the arguments,
    the cache key, the addresses) for a kernel of 8 tensors (2 of them parameters), 9 scalars and 2 constants, as
    the fused router head's backward takes: no GPU involved, so any machine compares two packages' figures."""
    tensors = [torch.empty(1024) for _ in range(6)] + [torch.nn.Parameter(torch.empty(1024)) for _ in range(2)]
    args, kwargs = tensors + [1024, 64, 64, 1, 64, 1, 7, 3, 1e-5], {"BLOCK": 64, "WIDTH": 256, "num_warps": 4}
    plan = launch._Plan(_seventeen_arguments)

    def prepare():
        launch.key_and_arguments(plan, *launch._bind(plan, args, kwargs))

    return min(timeit.repeat(prepare, number=20000, repeat=5)) / 20000 * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--key", action="store_true", help="only the launch's Python before its launcher, any device")
    if parser.parse_args().key:
        print(f"bind and key, 8 tensors + 9 scalars + 2 constants: {key_us():.2f} us per launch")
        return
    if not torch.cuda.is_available():
        raise SystemExit("launch_cost.py needs a CUDA or ROCm GPU")
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(64, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    logits = torch.randn(64, 17, device="cuda", dtype=torch.float32)
    biases = torch.zeros(17, device="cuda")
    a, b = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16), torch.randn(256, 64, device="cuda",
                                                                                dtype=torch.bfloat16)
    product = torch.empty(64, 64, device="cuda")
    rows = torch.randperm(8, device="cuda")
    torch_calls = [
        ("torch.add(out=)", lambda: torch.add(x, x, out=y)),
        ("x + x (allocates)", lambda: x + x),
        ("torch.empty_like", lambda: torch.empty_like(x)),
        ("torch.mm, bf16", lambda: torch.mm(a, b)),
        ("torch.mm(out_dtype=float32), bf16 inputs", lambda: torch.mm(a, b, out_dtype=torch.float32)),
        ("torch.addmm(out_dtype=float32, out=), bf16 inputs",
         lambda: torch.addmm(product, a, b, out_dtype=torch.float32, out=product)),
        ("torch.bmm, fp32", lambda: torch.bmm(product[None], product[None])),
        ("index_select", lambda: x.index_select(0, rows)),
    ]
    triton_calls = [
        ("RMSNorm forward: 2 allocations, 1 Triton launch",
         lambda: residual_rmsnorm._launch_forward(x, None, None, w, 1e-5, x.dtype)),
        ("the same as an autograd Function", lambda: residual_rmsnorm.RMSNorm.apply(x, w, 1e-5, True)),
        ("router epilogue (route_top1)", lambda: router.route_top1(logits, biases, 16)),
    ]
    for name, fn in torch_calls:
        print(f"{name:48s} {per_call_us(fn):7.1f} us")
    print(f"{'':48s} {'direct':>7s}    {'tensors':>7s}    {'Triton path':>11s}")
    for name, fn in triton_calls:
        direct = per_call_us(fn)
        with tensors_to_the_launcher():
            tensors = per_call_us(fn)
        with launch.through_triton():
            through_triton = per_call_us(fn)
        print(f"{name:48s} {direct:7.1f} us {tensors:7.1f} us {through_triton:8.1f} us")


if __name__ == "__main__":
    main()
