"""Run a training entry point unchanged, with measurement probes (benchmarks only)::

    ZAYA_BENCH_OUT=DIR [ZAYA_BENCH_PROFILE=FIRST:COUNT] python -m benchmarks.probe -m megatron_zaya.pretrain ARGS
    ZAYA_BENCH_OUT=DIR python -m benchmarks.probe benchmarks/gpt_pretrain.py ARGS

The entry runs as ``__main__`` (as ``python -m megatron_zaya.pretrain`` / ``python script`` would, except that a
script finds the repository root, not its own folder, on ``sys.path``: ``--spec benchmarks.gqa_sdpa ...``). The probes
are torch's global module hooks, so nothing of the library, Megatron or torch is replaced:

* ``DIR/memory.json`` (``memory.rank<r>.json`` on ranks other than 0): peak device memory
  (``torch.cuda.max_memory_allocated`` / ``_reserved``) at exit, and the caching allocator's retries, device
  allocations and frees over the run;
* ``DIR/routing.json``: tokens the ZAYA1 routers sent to an expert / all tokens (the skip class costs nothing);
* ``DIR/gc.json``: Python's garbage collections from the first model forward on (``gc.callbacks``): count and
  seconds per generation, and the longest pause;
* with ``ZAYA_BENCH_PROFILE=FIRST:COUNT``: ``torch.profiler`` from the first model forward of iteration FIRST
  to the first of iteration FIRST + COUNT (so iterations FIRST..FIRST+COUNT are perturbed: leave them out of
  timings). ``DIR/profile.json``: device time per step by component, see :func:`breakdown`, and the
  kernels the profiler linked to no op (e.g. Triton launches), by name.

Components: a forward op belongs to the innermost module range below (``bench::<component>``, opened by the
hooks while profiling); a backward op to the forward op that created its autograd node (same sequence
number); collectives are ``communication``; gradient accumulation into Megatron's DDP buffers (the
AccumulateGrad hooks) is ``grad_buffers``; torch's ``Optimizer.step`` ranges, and every other op between a
step's last backward op and the next step's first forward (Megatron's optimizer wrapper: grad copies, norm,
clipping, param copies; its grad-buffer zeroing; ZAYA1's balancing update), are ``optimizer``; whatever is
left is ``other`` (its largest ops are listed). Python stacks are not recorded: they cost ~400k events per
step of Megatron's Python.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import runpy
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd.profiler import record_function

# Module class name -> component. Module ranges nest; an op belongs to the innermost, so a parent's entry
# covers only what its children do not (e.g. the model: the LM head and loss; an MoE layer: token dispatch).
COMPONENTS = {
    "CompressedConvAttention": "attention", "SelfAttention": "attention",
    "ZayaRouter": "router", "TopKRouter": "router",
    "ZayaExperts": "experts", "SequentialMLP": "experts", "GroupedMLP": "experts", "TEGroupedMLP": "experts",
    "ZayaMoELayer": "moe_dispatch", "MoELayer": "moe_dispatch",
    "RMSNorm": "norms_residual", "TritonRMSNorm": "norms_residual", "ResidualScaling": "norms_residual",
    "ResidualAdd": "norms_residual", "InputScaling": "norms_residual",
    "ZayaTransformerLayer": "norms_residual", "TransformerLayer": "norms_residual",  # residual adds and casts
    "LanguageModelEmbedding": "embedding",
    "ZayaModel": "lm_head_loss", "GPTModel": "lm_head_loss",
}
MODELS = ("ZayaModel", "GPTModel")
RANGE = "bench::"
STEP = RANGE + "step"  # an empty range at the first forward of each training step
BACKWARD = "autograd::engine::evaluate_function: "
NAMED = ((("nccl", "c10d::", "record_param_comms", "gloo"), "communication"),
         ((BACKWARD + "torch::autograd::AccumulateGrad",), "grad_buffers"),
         (("Optimizer.step", "Optimizer.zero_grad"), "optimizer"))


def capturing() -> bool:
    """Whether this stream is capturing a CUDA graph: a hook must not keep tensors from that call."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def megatron_iteration() -> int:
    """The iteration Megatron is running, numbered as its log lines number them."""
    from megatron.training.global_vars import get_args

    return get_args().curr_iteration + 1


class Probe:
    def __init__(self, out: Path, profile: str | None):
        self.out = out
        rank = int(os.environ.get("RANK", "0"))
        self.suffix = "" if rank == 0 else f".rank{rank}"  # under torchrun each rank writes its own files
        self.first, self.count = (int(x) for x in profile.split(":")) if profile else (None, 0)
        self.profiler = None
        self.started = 0.0
        self.ranges: list = []
        self.routed = None
        self.tokens = 0
        self.done = False
        self.iteration = None
        self.forward_seen = False
        self.collections: dict[str, dict] = {}
        self.collection_started = 0.0
        self.longest_collection = 0.0

    # -- hooks --------------------------------------------------------------------------------------------
    def pre_forward(self, module, args):
        name = type(module).__name__
        self.forward_seen = self.forward_seen or name in MODELS
        if name in MODELS and self.first is not None and not self.done:
            iteration = megatron_iteration()
            if self.profiler is None and iteration == self.first:
                self.start()
            elif self.profiler is not None and iteration == self.first + self.count:
                self.stop()
            if self.profiler is not None and iteration != self.iteration:
                with record_function(STEP):
                    pass
            self.iteration = iteration
        if self.profiler is not None and name in COMPONENTS:
            rf = record_function(RANGE + COMPONENTS[name])
            rf.__enter__()
            self.ranges.append(rf)

    def post_forward(self, module, args, output):
        if name_is_component(module) and self.ranges:
            self.ranges.pop().__exit__(None, None, None)
        if type(module).__name__ == "ZayaRouter" and not capturing():
            # (A hook's tensors would be frozen into a CUDA graph being captured, and freed under it. With
            # --zaya-cuda-graphs the routing is sampled from the layers' eager warm-up passes instead.)
            routing_map = output[1]
            routed = routing_map.sum()
            self.routed = routed if self.routed is None else self.routed + routed
            self.tokens += routing_map.shape[0]

    def collection(self, phase, info):
        if phase == "start":
            self.collection_started = time.perf_counter()
        elif self.forward_seen:
            seconds = time.perf_counter() - self.collection_started
            counted = self.collections.setdefault(f"generation {info['generation']}", {"count": 0, "seconds": 0.0})
            counted["count"] += 1
            counted["seconds"] += seconds
            self.longest_collection = max(self.longest_collection, seconds)

    # -- profiling ----------------------------------------------------------------------------------------
    def start(self):
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.profiler = profile(activities=activities)
        self.profiler.__enter__()
        self._sync()
        self.started = time.perf_counter()

    def stop(self):
        self._sync()
        wall = time.perf_counter() - self.started
        while self.ranges:
            self.ranges.pop().__exit__(None, None, None)
        self.profiler.__exit__(None, None, None)
        result = breakdown(self.profiler.events(), self.count, device=torch.cuda.is_available())
        result.update(wall_ms_per_step=1e3 * wall / self.count, iterations=[self.first, self.first + self.count - 1])
        (self.out / f"profile{self.suffix}.json").write_text(json.dumps(result, indent=1))
        (self.out / f"profile_ops{self.suffix}.txt").write_text(self.profiler.key_averages().table(
            sort_by="self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total", row_limit=40))
        self.profiler, self.done = None, True

    @staticmethod
    def _sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def write(self):
        memory = {}
        if torch.cuda.is_available():
            stats = torch.cuda.memory_stats()
            memory = {"peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                      "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
                      # a retry frees the allocator's cached blocks after a failed device allocation: it waits for
                      # the device, a stall of an eager step that graphs (a private pool) do not have
                      "alloc_retries": stats.get("num_alloc_retries", 0),
                      "device_allocs": stats.get("num_device_alloc", 0),
                      "device_frees": stats.get("num_device_free", 0)}
        (self.out / f"memory{self.suffix}.json").write_text(json.dumps(memory))
        (self.out / f"gc{self.suffix}.json").write_text(json.dumps(
            {**self.collections, "longest_ms": 1e3 * self.longest_collection}))
        if self.tokens:
            routed = self.routed.item()
            (self.out / f"routing{self.suffix}.json").write_text(json.dumps(
                {"routed_tokens": routed, "router_tokens": self.tokens, "routed_fraction": routed / self.tokens}))


def name_is_component(module) -> bool:
    return type(module).__name__ in COMPONENTS


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (µs in, ms out): the time the device had work."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e3


def idle_between(kernels: list[tuple[float, float, str]]) -> dict[tuple[str, str], float]:
    """The device's idle time (µs) before each kernel that found it idle, summed by (the kernel that last ran, that
    kernel): where the device waited on the host, and between which launches. ``kernels``: (start, end, name)."""
    idle, reach, last = defaultdict(float), None, None
    for start, end, name in sorted(kernels):
        if reach is not None and start > reach:
            idle[last, name] += start - reach
        if reach is None or end > reach:
            reach, last = end, name
    return dict(idle)


def breakdown(events, steps: int, device: bool) -> dict:
    """Self time (device time on a GPU, CPU time otherwise) per component, in ms per step."""
    events = sorted(events, key=lambda e: e.time_range.start)  # forward ops before the backward that needs them
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    step_starts = [e.time_range.start for e in cpu if e.name == STEP] + [float("inf")]
    backward_ends = [e.time_range.end for e in cpu if e.name.startswith(BACKWARD)]
    # The optimizer phase of each step: from its last backward op to the next step's first forward.
    phases = []
    trace_end = max((e.time_range.end for e in events), default=0.0)
    for start, end in zip(step_starts, step_starts[1:]):
        last = max((t for t in backward_ends if start <= t < end), default=None)
        if last is not None:
            phases.append((last, min(end, trace_end)))
    forward_component = {}  # (thread, sequence number) of a forward op -> component
    component_of = {}

    def component(event) -> str:
        if id(event) in component_of:
            return component_of[id(event)]
        name = event.name
        found = next((c for prefixes, c in NAMED if name.startswith(prefixes)), None)
        if found is None and name.startswith(RANGE) and name != STEP:
            found = name[len(RANGE):]
        elif found is None and name.startswith(BACKWARD):
            found = forward_component.get((event.fwd_thread, event.sequence_nr), "other")
        if found is None and event.cpu_parent is not None:
            found = component(event.cpu_parent)
        if found is None:  # a top-level op outside the model
            t = event.time_range.start
            found = "optimizer" if any(a <= t < b for a, b in phases) else "other"
        component_of[id(event)] = found
        return found

    totals, top_ops = defaultdict(float), {"other": defaultdict(float), "optimizer": defaultdict(float)}
    for event in cpu:
        kind = component(event)
        if event.sequence_nr >= 0 and not event.name.startswith(BACKWARD):
            forward_component.setdefault((event.thread, event.sequence_nr), kind)
        micros = event.self_device_time_total if device else event.self_cpu_time_total
        totals[kind] += micros
        if kind in top_ops and micros:
            top_ops[kind][event.name] += micros
    # Device-side copies of CPU ranges (record_function's gpu_user_annotation: our bench:: ranges, torch's
    # Optimizer.step#...) span kernels, they are not kernels: counting them would count those kernels twice.
    ranges = {e.name for e in cpu}
    kernels = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU and e.name not in ranges]
    device_total = sum(e.time_range.elapsed_us() for e in kernels)
    if device and device_total > sum(totals.values()):
        totals["unattributed"] = device_total - sum(totals.values())  # kernels the profiler linked to no op
    # Which kernels those are, by name: all device time minus what the profiler gave to CPU ops.
    unlinked = defaultdict(float)
    for e in kernels:
        unlinked[e.name] += e.time_range.elapsed_us()
    for e in cpu:
        for kernel in getattr(e, "kernels", ()):
            unlinked[kernel.name] -= kernel.duration
    per_step = {k: v / 1e3 / steps for k, v in sorted(totals.items(), key=lambda kv: -kv[1]) if v}
    top = {kind: {k: v / 1e3 / steps for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:12]}
           for kind, ops in top_ops.items()}
    # The optimizer phase on the host clock, and the device's busy time in it: a gap means the host is the limit.
    in_phase = [(e.time_range.start, e.time_range.end) for e in kernels
                if any(a <= e.time_range.start < b for a, b in phases)]
    return {"time": "device" if device else "cpu", "ms_per_step": per_step,
            "busy_ms_per_step": busy_ms([(e.time_range.start, e.time_range.end) for e in kernels]) / steps
            if device else sum(per_step.values()),
            "optimizer_phase_wall_ms_per_step": sum(b - a for a, b in phases) / 1e3 / max(len(phases), 1),
            "optimizer_phase_busy_ms_per_step": busy_ms(in_phase) / max(len(phases), 1),
            "other_top_ops_ms_per_step": top["other"],
            "optimizer_top_ops_ms_per_step": top["optimizer"],
            "unattributed_top_kernels_ms_per_step": {k: v / 1e3 / steps for k, v in
                                                     sorted(unlinked.items(), key=lambda kv: -kv[1])[:15] if v > 0}}


def main(argv: list[str]) -> None:
    out = Path(os.environ["ZAYA_BENCH_OUT"])
    out.mkdir(parents=True, exist_ok=True)
    probe = Probe(out, os.environ.get("ZAYA_BENCH_PROFILE"))
    torch.nn.modules.module.register_module_forward_pre_hook(probe.pre_forward)
    torch.nn.modules.module.register_module_forward_hook(probe.post_forward)
    gc.callbacks.append(probe.collection)
    atexit.register(probe.write)
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
