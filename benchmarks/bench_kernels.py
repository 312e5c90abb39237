"""Benchmark megatron_zaya's Triton kernels against their torch references at ZAYA1-8B shapes.

    python -m benchmarks.bench_kernels                      # all kernels; CUDA or ROCm GPU; minutes (torch.compile)
    python -m benchmarks.bench_kernels --kernels rmsnorm,swiglu --no-compile
    python -m benchmarks.bench_kernels --smoke              # tiny shapes, any device: checks the script runs
    python -m benchmarks.bench_kernels --batch 4 --kernels rmsnorm   # T = 16384 (the RMSNorm anchors)
    python -m benchmarks.bench_kernels --kernels swiglu --rounds 9   # interleaved rounds, for close calls

Shapes: T = 8192 tokens (4096 x 2), D = 2048, F = 2048, V = 262272, E = 16, d = 128, nq = 8, nkv = 2,
bf16 activations. For each kernel and pass (forward; forward + backward) it prints the median time of
the Triton kernel, of the eager torch reference and of ``torch.compile(reference)`` (with ``--rounds N``, the
median of N rounds that time the three in rotating order), the kernel's throughput and the speed-ups.
Memory-bound cases are timed as CUDA-graph replays (``--timer graph``, the default), so that a ~20 µs kernel is
not measured as its ~50 µs of Python launch overhead; the GEMM-bound ones, and any case whose capture fails,
with CUDA events around each call. Throughput is effective GB/s (the bytes a fused implementation has to move:
inputs read once, outputs written once) for the memory-bound kernels and TFLOP/s (useful FLOPs) for the
GEMM-bound ones; graph-timed cases also print their time as a share of one device copy of the same bytes,
timed the same way (for the ~1 MB router epilogue that copy is latency-bound too). Anchors measured on an H200:
device copy 3.6-4.3 TB/s; eager RMSNorm ~300 GB/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch

from megatron_zaya.kernels import cca, cross_entropy, grouped_gemm, residual_rmsnorm, router, swiglu
from megatron_zaya.ops import cca as cca_ops
from megatron_zaya.ops import experts as expert_ops
from megatron_zaya.ops import lm_head as lm_head_ops
from megatron_zaya.ops import residual_norm
from megatron_zaya.ops import router as router_ops

from .timing import gpu_or_smoke

BF16, FP32 = torch.bfloat16, torch.float32


@dataclasses.dataclass
class Shapes:
    seq: int = 4096
    batch: int = 2
    hidden: int = 2048
    ffn: int = 2048
    vocab: int = 262272
    experts: int = 16
    head_dim: int = 128
    n_q: int = 8
    n_kv: int = 2
    ce_tokens: int = 8192  # tokens for the cross-entropy cases
    router: int = 256  # the router MLP's width R

    @property
    def tokens(self) -> int:
        return self.seq * self.batch


SMOKE = Shapes(seq=32, batch=2, hidden=64, ffn=32, vocab=1000, experts=4, head_dim=16, n_q=4, n_kv=2, ce_tokens=64,
               router=32)


@dataclasses.dataclass
class Case:
    name: str
    kernel: Callable
    reference: Callable
    make_inputs: Callable[[], tuple[list[torch.Tensor], tuple]]  # (differentiable tensors, other arguments)
    bytes: tuple[float, float] = (0.0, 0.0)  # (forward, backward) bytes moved by a fused implementation
    flops: tuple[float, float] = (0.0, 0.0)  # (forward, backward) useful FLOPs
    compile: bool = True  # also time torch.compile(reference)
    uniform_grad: bool = False  # backward with one gradient for every output element, as Megatron's loss gives


def cases(s: Shapes, device: str) -> list[Case]:
    def randn(*shape, dtype=BF16, scale=1.0):
        return (scale * torch.randn(*shape, device=device)).to(dtype).requires_grad_()

    t, d, f, v, e, r = s.tokens, s.hidden, s.ffn, s.vocab, s.experts, s.router
    q_ch, k_ch, rot = s.n_q * s.head_dim, s.n_kv * s.head_dim, s.head_dim // 2
    angles = torch.outer(torch.arange(s.seq, device=device, dtype=FP32),
                         1e4 ** (-torch.arange(0, rot, 2, device=device) / rot))  # fmt: skip
    angles = torch.cat([angles, angles], dim=-1)
    labels = torch.randint(0, v, (s.ce_tokens,), device=device)
    counts = torch.bincount(torch.randint(0, e, (t,), device=device), minlength=e)  # on the device: no host sync

    def lm_head_inputs():
        return [randn(s.ce_tokens, d), randn(v, d, scale=0.02)], (labels,)

    lm_head_flops = (2 * s.ce_tokens * v * d, 4 * s.ce_tokens * v * d)
    return [
        Case("rmsnorm", residual_rmsnorm.rms_norm, residual_norm.rms_norm,
             lambda: ([randn(t, d), randn(d)], (1e-5,)), bytes=(4 * t * d, 6 * t * d)),
        Case("residual_rmsnorm", residual_rmsnorm.residual_rms_norm, residual_norm.residual_rms_norm,
             lambda: ([randn(t, d), randn(t, d, dtype=FP32), *(randn(d) for _ in range(5))], (1e-5,)),
             bytes=(12 * t * d, 18 * t * d)),
        Case("residual_norm", residual_rmsnorm.residual_norm, residual_norm.residual_norm,
             lambda: ([randn(t, d, dtype=FP32), randn(d)], (1e-5,)), bytes=(6 * t * d, 10 * t * d)),
        Case("residual_merge", residual_rmsnorm.residual_merge, residual_norm.residual_merge,
             lambda: ([randn(t, d), randn(t, d, dtype=FP32), *(randn(d) for _ in range(4))], ()),
             bytes=(10 * t * d, 16 * t * d)),
        Case("swiglu", swiglu.swiglu, expert_ops.swiglu, lambda: ([randn(t, 2 * f)], ()),
             bytes=(6 * t * f, 10 * t * f)),
        Case("swiglu_weighted", swiglu.swiglu, expert_ops.swiglu,
             lambda: ([randn(t, 2 * f), torch.rand(t, 1, device=device, requires_grad=True)], ()),
             bytes=(6 * t * f, 10 * t * f)),
        Case("router", router.route_top1, router_ops.route_top1,
             lambda: ([randn(t, e + 1, dtype=FP32)], (torch.zeros(e + 1, device=device), e)),
             bytes=(4 * t * (e + 1) + 5 * t * e + 4 * t, 8 * t * (e + 1) + 4 * t * e + 4 * t)),
        Case("router_head", router.route_head, router_ops.route_head,
             lambda: ([randn(t, r, dtype=FP32), randn(t, r, dtype=FP32), randn(r), randn(r),
                       randn(r, r, scale=r ** -0.5), randn(r), randn(r, r, scale=r ** -0.5), randn(r),
                       randn(e + 1, r, scale=r ** -0.5)], (torch.zeros(e + 1, device=device), 1e-5, e)),
             flops=(2 * t * (2 * r * r + r * (e + 1)), 4 * t * (2 * r * r + r * (e + 1)))),
        Case("cross_entropy", cross_entropy.cross_entropy, lm_head_ops.cross_entropy,
             lambda: ([randn(s.ce_tokens, v, scale=3)], (labels,)), bytes=(2 * s.ce_tokens * v, 4 * s.ce_tokens * v)),
        Case("linear_cross_entropy", cross_entropy.linear_cross_entropy, lm_head_ops.linear_cross_entropy,
             lm_head_inputs, flops=lm_head_flops, uniform_grad=True),
        Case("linear_ce_recompute", functools.partial(cross_entropy.linear_cross_entropy, grad_in_forward=False),
             lm_head_ops.linear_cross_entropy, lm_head_inputs, flops=lm_head_flops, compile=False,
             uniform_grad=True),
        # twice the default chunk of tokens (2^29 / V): half the fp32 weight-gradient read-modify-writes, twice
        # the chunk's logits at the memory peak
        Case("linear_ce_2x_token_chunk", functools.partial(
                 cross_entropy.linear_cross_entropy, token_chunk=2 * cross_entropy.forward_token_chunk(v)),
             lm_head_ops.linear_cross_entropy, lm_head_inputs, flops=lm_head_flops, compile=False,
             uniform_grad=True),
        # the weight's gradient with one GEMM per 2, 4 or 8 chunks of tokens: its fp32 read-modify-writes halved,
        # quartered or eighthed, the chunks' bf16 logits' gradients side by side at the memory peak
        *(Case(f"linear_ce_wgrad_{chunks}_chunks", functools.partial(
                   cross_entropy.linear_cross_entropy, weight_grad_chunks=chunks),
               lm_head_ops.linear_cross_entropy, lm_head_inputs, flops=lm_head_flops, compile=False,
               uniform_grad=True) for chunks in (2, 4, 8)),
        Case("cca_qk", _cca_qk_kernel, _cca_qk_reference,
             lambda: ([randn(s.seq, s.batch, q_ch), randn(s.seq, s.batch, k_ch), randn(q_ch, 2), randn(q_ch),
                       randn(k_ch, 2), randn(k_ch), randn(q_ch, s.head_dim, 2, scale=0.05), randn(q_ch),
                       randn(k_ch, s.head_dim, 2, scale=0.05), randn(k_ch), randn(s.n_kv)],
                      (angles[:, None],)),
             bytes=(4 * t * (q_ch + k_ch), 8 * t * (q_ch + k_ch))),
        Case("cca_convs", cca.causal_qk_convs_fused, cca_ops.causal_convs,
             lambda: ([randn(s.seq, s.batch, q_ch), randn(q_ch, 2), randn(q_ch), randn(q_ch, s.head_dim, 2, scale=0.05),
                       randn(q_ch)], (s.n_q,)),
             bytes=(4 * t * q_ch, 6 * t * q_ch)),
        Case("grouped_gemm_fc1", grouped_gemm.grouped_gemm, expert_ops.grouped_gemm,
             lambda: ([randn(t, d), randn(e, 2 * f, d, scale=0.02)], (counts,)),
             flops=(2 * t * 2 * f * d, 4 * t * 2 * f * d), compile=False),
        Case("grouped_gemm_fc2", grouped_gemm.grouped_gemm, expert_ops.grouped_gemm,
             lambda: ([randn(t, f), randn(e, d, f, scale=0.02)], (counts,)),
             flops=(2 * t * d * f, 4 * t * d * f), compile=False),
    ]  # fmt: skip


def _cca_qk_kernel(*tensors_and_angles):
    """``kernels.cca.cca_qk`` as ``ops.cca.fused_cca_qk`` calls it: the fp32 cos and sin of the angles."""
    *tensors, angles = tensors_and_angles
    return cca.cca_qk(*tensors, angles.cos(), angles.sin())


def _cca_qk_reference(q0, k0, wq1, bq1, wk1, bk1, wq2, bq2, wk2, bk2, temp, angles):
    """``ops.cca.cca_qk``, the model's q/k, on the kernel's arguments."""
    conv = SimpleNamespace(q_depthwise_weight=wq1.unsqueeze(1), q_depthwise_bias=bq1, q_grouped_weight=wq2,
                           q_grouped_bias=bq2, k_depthwise_weight=wk1.unsqueeze(1), k_depthwise_bias=bk1,
                           k_grouped_weight=wk2, k_grouped_bias=bk2)
    return cca_ops.cca_qk(q0, k0, conv, temp, angles[:, :, None], head_dim=wq2.shape[1])


def _differentiable(outputs) -> list[torch.Tensor]:
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    return [o for o in outputs if o.requires_grad]


def median_ms(fn: Callable[[], object], device: str, graph: bool = False) -> float:
    """Median milliseconds of ``fn``: device time of CUDA-graph replays (``graph``) or CUDA events per call."""
    if device == "cuda":
        import triton.testing

        if graph:
            try:
                return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
            except RuntimeError as error:  # e.g. a host sync inside fn: time it call by call instead
                print(f"  (CUDA-graph capture failed, timing with events: {str(error).splitlines()[0][:80]})")
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return sorted(times)[2]


def warm_up(fn: Callable, tensors: list[torch.Tensor], args: tuple) -> None:
    """One untimed forward + backward: compiles (and fails on resources) outside a CUDA-graph capture, which a
    failure would poison for every later capture."""
    outputs = _differentiable(fn(*tensors, *args))
    torch.autograd.grad(outputs, tensors, [torch.ones_like(o) for o in outputs])


def time_passes(fn: Callable, tensors: list[torch.Tensor], args: tuple, device: str,
                 uniform_grad: bool = False, graph: bool = False) -> tuple[float, float, float]:
    """(forward ms, forward + backward ms, extra peak GiB of forward + backward) of ``fn(*tensors, *args)``."""
    outputs = _differentiable(fn(*tensors, *args))
    grads = [torch.full_like(o, 1 / o.numel()) if uniform_grad else torch.randn_like(o) for o in outputs]
    del outputs

    def step():
        torch.autograd.grad(_differentiable(fn(*tensors, *args)), tensors, grads)

    peak = 0.0
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**30
    return median_ms(lambda: fn(*tensors, *args), device, graph), median_ms(step, device, graph), peak


def _throughput(case: Case, backward: bool, ms: float) -> str:
    work = case.bytes if case.bytes != (0.0, 0.0) else case.flops
    amount = work[0] + (work[1] if backward else 0.0)
    unit, scale = ("GB/s", 1e9) if case.bytes != (0.0, 0.0) else ("TFLOP/s", 1e12)
    return f"{amount / (ms * 1e-3) / scale:9.1f} {unit}"


def run(case: Case, device: str, use_compile: bool, timer: str, rounds: int = 1) -> None:
    tensors, args = case.make_inputs()
    graph = device == "cuda" and timer == "graph" and case.bytes != (0.0, 0.0)  # memory-bound: graph replays
    contenders = {"triton": case.kernel, "eager": case.reference}
    if use_compile and case.compile:
        contenders["compile"] = torch.compile(case.reference)
    samples = {name: [] for name in contenders}
    for round_ in range(rounds):  # each round in another order: a drift of the GPU's clock favours no one
        names = list(contenders)[round_ % len(contenders):] + list(contenders)[: round_ % len(contenders)]
        for name in names:
            try:
                samples[name].append(time_passes(contenders[name], tensors, args, device, case.uniform_grad, graph))
            except Exception as error:  # report and go on: a compile failure is a result, not a crash
                if name != "compile":
                    raise
                print(f"  {case.name}: torch.compile failed: {type(error).__name__}: "
                      f"{str(error).splitlines()[0][:100]}")
                del contenders[name], samples[name]
    timings = {name: [statistics.median(column) for column in zip(*runs)] for name, runs in samples.items()}
    for index, label in enumerate(("fwd", "fwd+bwd")):
        kernel_ms = timings["triton"][index]
        line = (f"{case.name:22s} {label:8s} {kernel_ms:9.3f} ms {_throughput(case, index == 1, kernel_ms)}"
                f" [{'graph' if graph else 'events'}]")
        if graph:
            moved = case.bytes[0] + (case.bytes[1] if index == 1 else 0.0)
            line += f" | {same_bytes_copy_ms(moved, device) / kernel_ms:6.1%} of a copy of the same bytes"
        for other in ("eager", "compile"):
            if other in timings:
                line += f" | {other} {timings[other][index]:9.3f} ms  x{timings[other][index] / kernel_ms:5.2f}"
        if index == 1 and device == "cuda":
            line += f" | extra peak GiB: triton {timings['triton'][2]:.2f}, eager {timings['eager'][2]:.2f}"
        print(line)
    del tensors, args
    if device == "cuda":
        torch.cuda.empty_cache()


def same_bytes_copy_ms(moved: float, device: str) -> float:
    """Graph-replay milliseconds of one device copy that reads and writes ``moved`` bytes in all: the rate a
    kernel of that size can reach, which for a ~1 MB kernel is set by launch latency, not by bandwidth."""
    source = torch.empty(int(moved) // 2, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return median_ms(lambda: target.copy_(source), device, graph=True)


def copy_anchor(device: str, shapes: Shapes, graph: bool) -> None:
    """Device copy rate, large (256 × the [T, D] activation) and at one [T, D] activation (the kernels' size)."""
    for label, elements in (("copy (anchor)", shapes.tokens * shapes.hidden * 32),
                            ("copy [T, D] bf16", shapes.tokens * shapes.hidden)):
        x = torch.empty(elements, dtype=BF16, device=device)
        y = torch.empty_like(x)
        ms = median_ms(lambda: y.copy_(x), device, graph)
        print(f"{label:22s} {'':8s} {ms:9.3f} ms {2 * x.numel() * 2 / (ms * 1e-3) / 1e9:9.1f} GB/s")


def gemm_anchor(device: str, shapes: Shapes) -> None:
    """bf16 GEMM rate at an LM-head tile, with bf16 and with fp32 output (the fused LM head's GEMMs)."""
    a = torch.randn(shapes.ce_tokens, shapes.hidden, dtype=BF16, device=device)
    b = torch.randn(shapes.hidden, 32768, dtype=BF16, device=device)
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    for label, fn in (("bf16 out", lambda: a @ b), ("fp32 out", lambda: torch.mm(a, b, out_dtype=FP32)),
                      ("fp32 upcast", lambda: a.float() @ b.float())):
        try:
            ms = median_ms(fn, device)
        except (RuntimeError, NotImplementedError) as error:
            print(f"{'gemm ' + label:22s} unavailable: {str(error).splitlines()[0][:80]}")
            continue
        print(f"{'gemm ' + label:22s} {'':8s} {ms:9.3f} ms {flops / (ms * 1e-3) / 1e12:9.1f} TFLOP/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", help="comma-separated case names (default: all)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile of the references")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device, to check the script")
    parser.add_argument("--batch", type=int, default=2,
                        help="sequences of 4096 tokens (T = 4096 x batch; the RMSNorm anchors are at batch 4)")
    parser.add_argument("--timer", choices=("graph", "events"), default="graph",
                        help="memory-bound cases as CUDA-graph replays (default) or CUDA events per call")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time kernel, eager and compiled this many times each, in rotating order; report medians")
    options = parser.parse_args()
    if options.rounds < 1:
        parser.error(f"--rounds {options.rounds}: need at least one")
    if options.batch < 1:
        parser.error(f"--batch {options.batch}: need at least one sequence")
    device = gpu_or_smoke("bench_kernels.py", options.smoke)
    shapes = SMOKE if options.smoke else Shapes(batch=options.batch)
    torch.manual_seed(0)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"device {name} | torch {torch.__version__} | tokens {shapes.tokens} | hidden {shapes.hidden}")
    copy_anchor(device, shapes, device == "cuda" and options.timer == "graph")
    if device == "cuda":
        gemm_anchor(device, shapes)
    selected = set(options.kernels.split(",")) if options.kernels else None
    for case in cases(shapes, device):
        if selected is None or case.name in selected:
            run(case, device, not options.no_compile and not options.smoke, options.timer, options.rounds)


if __name__ == "__main__":
    main()
