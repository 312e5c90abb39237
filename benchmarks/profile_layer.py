"""Where one ZAYA1 decoder layer's forward + backward spends its time, kernel by kernel.

    python -m benchmarks.profile_layer                 # S=4096, B=2, ZAYA1-8B width, one GPU
    python -m benchmarks.profile_layer --cuda-graphs   # the layer as --zaya-cuda-graphs replays it
    python -m benchmarks.profile_layer --as-trained    # under Megatron's DDP, with selective recomputation
    python -m benchmarks.profile_layer --kernels router,residual,cca,lm_head,experts   # a kernel set (--zaya-kernels)
    python -m benchmarks.profile_layer --as-trained --against router,router_head,residual,cca,lm_head,experts
                                                       # and a baseline layer in the same process, timed in turns
    python -m benchmarks.profile_layer --as-trained --grad-reduce-in-bf16   # main_grad in bf16, as the 40-layer runs
    python -m benchmarks.profile_layer --gemm-tuning wgrad_warps=4,wgrad_stages=4   # grouped_gemm.GEMM_TUNING changed
    python -m benchmarks.profile_layer --smoke         # tiny widths on any device: checks the script

Builds layer 0 of a one-layer ``zaya1-8b-shallow`` model as training builds it (the kernel patches that apply
on the device), runs forward + backward on the fp32 residual stream as ``inprocess.py eager`` does, and prints
(``--as-trained``: the model wrapped in Megatron's DDP with the distributed optimizer's buffer layout, whose hooks
add each gradient to its fp32 ``main_grad``, Megatron's linears accumulating theirs there directly where the CLI
would, and ``--recompute-granularity selective``'s default pieces recomputed, as the 40-layer runs of
docs/benchmarks.md train; without it the layer's gradients accumulate in ``.grad`` and nothing is recomputed)

* with ``--against-triton-launch``, the same layer with every kernel launched through ``kernel[grid](...)`` rather
  than ``kernels.launch``'s cached launcher, and with ``--against-tensor-arguments``, through that launcher given
  tensors rather than their addresses: timed in alternating rounds as below;
* with ``--against KERNELS`` or ``--against-on-the-graph``, a second layer, the baseline, built in the same process
  with that kernel set, or with the sublayer ops' parameters left on autograd's graph (as without the
  ``training_loop.gradient_ready_calls`` patch): both timed in alternating rounds, their median wall times and ratio
  (what varies from process to process, clocks and the host's state, cancels out);
* wall time per step (CUDA events, no profiler), each step on a synchronised device and ten steps back to back (as
  a training step runs its layers: the host launches ahead), and the device's busy time per step (the union of
  kernel intervals under ``torch.profiler``): back to back well above busy means the host is the slower (launches);
* the kernels by device time per step, with their launch counts, and the torch ops that launched the most;
* with ``--gaps``, the device's idle time per step between kernels, by the pair of kernels around each gap (the
  one that last ran, the one the device waited for): which stretch of launches the host was late with;
* with ``--cprofile``, the host side: Python functions by own time and by cumulative time per step
  (``cProfile``), to find where a host-bound step spends its launches;
* with ``--host-parts``, the host's time per part of the layer (:data:`PARTS`), forward and backward, and the
  recomputation and DDP's gradient hooks apart: a forward part is the wall time inside its module's call, less
  the parts called inside it; a backward part is the wall time of the autograd nodes its forward created, less
  the nodes and recomputed parts run inside them.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch

from megatron_zaya.kernels import launch

from .inprocess import DEVICE, GPU, setup_single_process, zaya_cfg
from .launch_cost import tensors_to_the_launcher
from .probe import busy_ms, idle_between
from .timing import call_times


def layer_step(smoke: bool, seq: int, batch: int, cuda_graphs: bool = False, as_trained: bool = False,
               kernels: str = "all", reference_sort: bool = False, on_the_graph: bool = False,
               bf16_main_grad: bool = False):
    from megatron_zaya.pretrained import build_single_process_model

    setup_single_process()
    trained = {}
    if as_trained:  # as the CLI configures it: Megatron's linears add weight gradients into main_grad where they can
        from megatron_zaya.training.arguments import weight_gradient_fusion_available

        trained = {"recompute_granularity": "selective",
                   "gradient_accumulation_fusion": weight_gradient_fusion_available()}
    cfg = zaya_cfg(smoke, 1, seq, cuda_graphs=cuda_graphs, kernels=kernels, **trained)
    model = build_single_process_model(cfg).to(DEVICE).train()
    ddp = None
    if as_trained:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        # the distributed optimizer's buffer layout, as the 40-layer runs train: each parameter starts on 64 elements
        # (without it, linear_q's, _k's and _v's main_grads sit 8 bytes off, and their weight gradients' GEMMs run on
        # slower unaligned kernels)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=not bf16_main_grad,
                                                   use_distributed_optimizer=True)
        ddp = _wrapped_on_a_side_stream(lambda: DistributedDataParallel(cfg, ddp_config, model))
        for param in model.parameters() if on_the_graph else ():  # the sublayer ops return gradients to autograd
            param.__dict__.pop("ddp_grad_ready", None)
    layer, rotary = model.decoder.layers[0], model.rotary_pos_emb["global"](seq)
    if reference_sort:  # the baseline of the sort-by-expert kernel, in a model otherwise as built
        from megatron_zaya.ops.experts import sort_by_expert

        layer.mlp.sort_by_expert = sort_by_expert
    x = torch.randn(seq, batch, cfg.hidden_size, device=DEVICE, requires_grad=True)  # the fp32 residual stream
    grad = torch.randn_like(x)

    def step():
        x.grad = None  # the stream's gradient is stored, not added to the last step's: no launch of the profile's own
        out, _ = layer(x, rotary_pos_emb=rotary)
        out.backward(grad)

    # DDP's gradient hooks hang on the parameters' AccumulateGrad nodes, which only DDP keeps alive: the step
    # holds it, or a garbage collection drops the hooks and the gradients pile up in .grad again.
    step.ddp = ddp
    step.layer = layer

    if not cuda_graphs:
        return step
    from megatron_zaya.model.cuda_graphs import LayerGraphs

    graphs = LayerGraphs([layer])  # what --zaya-cuda-graphs runs: the captured forward and backward, replayed

    def graphed_step():
        x.grad = None
        replayed = graphs(x, None, None, {"global": rotary})
        if replayed is None:  # the warning above names the capture's error; eager timings would be mislabelled
            raise SystemExit("profile_layer: the layer's CUDA graph capture failed (the warning above); nothing is "
                             "measured with --cuda-graphs")
        replayed[0].backward(grad)

    graphed_step.ddp = ddp

    return graphed_step


def _wrapped_on_a_side_stream(wrap):
    """``wrap()`` on a side stream, as Megatron's ``pretrain`` wraps DDP: the gradient accumulators DDP keeps record
    the stream they were made on, and a CUDA graph's captured backward that reaches accumulators made on the legacy
    default stream fails (the legacy stream would wait on the capturing one)."""
    if not GPU:
        return wrap()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        wrapped = wrap()
    torch.cuda.current_stream().wait_stream(side)
    return wrapped


# A layer's submodule (its path in the layer) -> the part of the layer whose host time its call counts to.
PARTS = {
    "": "the layer's own code (residual stream, recomputed regions)",
    "input_layernorm": "norms", "pre_mlp_layernorm": "norms",
    "self_attention.linear_q": "projections", "self_attention.linear_k": "projections",
    "self_attention.linear_v": "projections", "self_attention.linear_proj": "projections",
    "self_attention": "cca convolutions, epilogue, value delay (with the cca_sublayer op: the input norm, projections)",
    "self_attention.core_attention": "attention",
    "self_attn_bda": "residual scaling", "mlp_bda": "residual scaling",
    "mlp.router": "router", "mlp.experts": "experts", "mlp": "dispatch, combine (with the moe op: the whole sublayer)",
}
PART = "part::"
NODE = "autograd::engine::evaluate_function: "


def host_parts(layer, step, steps: int) -> dict[str, float]:
    """Host wall time per part of ``layer``'s step, ms per step (see the module docstring)."""
    open_ranges = []

    def enter(part):
        def pre_hook(module, args):
            recomputed = torch._C._current_graph_task_id() != -1  # a forward called from inside a backward
            open_ranges.append(torch.profiler.record_function(PART + ("recompute: " if recomputed else "") + part))
            open_ranges[-1].__enter__()
        return pre_hook

    def leave(module, args, output):
        open_ranges.pop().__exit__(None, None, None)

    modules = dict(layer.named_modules())
    hooks = [h for path, part in PARTS.items() if path in modules
             for h in (modules[path].register_forward_pre_hook(enter(part)),
                       modules[path].register_forward_hook(leave))]
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
            if GPU:
                torch.cuda.synchronize()
    finally:
        for hook in hooks:
            hook.remove()
    events = prof.events()

    def part_of(event):  # the innermost part range around a forward op
        while event is not None and not event.name.startswith(PART):
            event = event.cpu_parent
        return event.name[len(PART):] if event is not None else None

    created_by = {}  # (thread, sequence number) of a forward op -> its part; ops inside a backward carry numbers too
    for event in events:
        if event.sequence_nr >= 0 and not event.name.startswith(NODE) and part_of(event):
            created_by.setdefault((event.thread, event.sequence_nr), part_of(event))

    def label(event):
        if event.name.startswith(PART):
            return "forward: " + event.name[len(PART):]
        if event.name.startswith(NODE):
            if "AccumulateGrad" in event.name:
                return "backward: DDP gradient hooks"
            if event.sequence_nr < 0:  # a node no forward op recorded: views of gradients, hooks
                return "backward: nodes without a forward op"
            return "backward: " + (created_by.get((event.fwd_thread, event.sequence_nr)) or "outside the layer")
        return None

    def counted_within(event):  # the labelled events nearest below ``event``
        for child in event.cpu_children:
            if label(child):
                yield child
            else:
                yield from counted_within(child)

    totals = defaultdict(float)
    for event in events:
        name = label(event)
        if name:
            inner = sum(child.time_range.elapsed_us() for child in counted_within(event))
            totals[name.replace("backward: recompute: ", "recompute: ").replace("forward: recompute: ", "recompute: ")
                   ] += (event.time_range.elapsed_us() - inner) / 1e3 / steps
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--cprofile", action="store_true", help="also print the host-side Python profile")
    parser.add_argument("--gaps", action="store_true", help="also print the device's idle time by kernel pair")
    parser.add_argument("--host-parts", action="store_true", help="also print the host's time per part of the layer")
    parser.add_argument("--cuda-graphs", action="store_true", help="the layer replayed as CUDA graphs")
    parser.add_argument("--as-trained", action="store_true",
                        help="under Megatron's DDP (main_grad accumulation), with selective recomputation")
    parser.add_argument("--grad-reduce-in-bf16", action="store_true",
                        help="with --as-trained: main_grad in bf16 (Megatron's flag), not fp32")
    parser.add_argument("--kernels", default="all", help="--zaya-kernels: all (as the CLI chooses) or a list of ops")
    parser.add_argument("--gemm-tuning", metavar="KEY=VALUE,...", type=gemm_tuning, default={},
                        help="grouped_gemm.GEMM_TUNING entries for this run (e.g. a baseline's setting)")
    parser.add_argument("--reference-sort", action="store_true",
                        help="the MoE dispatch's sort by expert as its torch reference, not its kernel")
    parser.add_argument("--against", metavar="KERNELS", help="a baseline layer with this kernel set, same process")
    parser.add_argument("--against-on-the-graph", action="store_true",
                        help="a baseline layer whose sublayer ops leave their parameters on autograd's graph")
    parser.add_argument("--against-triton-launch", action="store_true",
                        help="a baseline: the same layer with every kernel launched through kernel[grid](...)")
    parser.add_argument("--against-tensor-arguments", action="store_true",
                        help="a baseline: the same layer, its cached launcher given tensors, not their addresses")
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds of 10 steps with a baseline")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.cuda_graphs and not GPU:
        raise SystemExit("--cuda-graphs needs a GPU")
    if not GPU and not args.smoke:
        raise SystemExit("profile_layer.py needs a CUDA or ROCm GPU; use --smoke to check the script on CPU")
    seq, batch = (64, 2) if args.smoke else (args.seq, args.batch)
    if args.gemm_tuning:
        from megatron_zaya.kernels.grouped_gemm import GEMM_TUNING
        from megatron_zaya.kernels.utils import platform

        GEMM_TUNING[platform(torch.device(DEVICE))].update(args.gemm_tuning)
    step = layer_step(args.smoke, seq, batch, args.cuda_graphs, args.as_trained, args.kernels, args.reference_sort,
                      bf16_main_grad=args.grad_reduce_in_bf16)
    wall = statistics.median(call_times(step, warmup=3, iters=10))
    back_to_back = statistics.median(call_times(step, warmup=0, iters=3, calls=10)) if GPU else None
    if args.against or args.against_on_the_graph:
        baseline = layer_step(args.smoke, seq, batch, args.cuda_graphs, args.as_trained, args.against or args.kernels,
                              args.reference_sort, args.against_on_the_graph, args.grad_reduce_in_bf16)
        wall, baseline_wall = in_turns(step, baseline, args.rounds)
        print(f"same process, {args.rounds} alternating rounds of 10 steps: wall {wall:.3f} ms/step against the "
              f"baseline's {baseline_wall:.3f} ({wall / baseline_wall:.3f}x; baseline: "
              f"--kernels {args.against or args.kernels}{', on the graph' if args.against_on_the_graph else ''})")
    if args.against_triton_launch:
        wall, baseline_wall = in_turns(step, within(launch.through_triton, step), args.rounds)
        print(f"same process, {args.rounds} alternating rounds of 10 steps: wall {wall:.3f} ms/step against "
              f"{baseline_wall:.3f} with Triton's launch path ({wall / baseline_wall:.3f}x)")
    if args.against_tensor_arguments:
        wall, baseline_wall = in_turns(step, within(tensors_to_the_launcher, step), args.rounds)
        print(f"same process, {args.rounds} alternating rounds of 10 steps: wall {wall:.3f} ms/step against "
              f"{baseline_wall:.3f} with tensors given to the launcher ({wall / baseline_wall:.3f}x)")

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if GPU else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        if GPU:
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_kernel = defaultdict(lambda: [0.0, 0])
    for event in kernels:
        per_kernel[event.name][0] += event.device_time / args.steps / 1e3
        per_kernel[event.name][1] += 1
    busy = busy_ms([(e.time_range.start, e.time_range.end) for e in kernels]) / args.steps
    total = sum(ms for ms, _ in per_kernel.values())
    print(f"one ZAYA1 layer fwd+bwd, S={seq} B={batch}: wall {wall:.3f} ms/step, device busy {busy:.3f} ms/step, "
          f"kernels {total:.3f} ms/step, {len(kernels) // args.steps} launches/step")
    if GPU:
        print(f"ten steps back to back: wall {back_to_back:.3f} ms/step, {back_to_back / busy:.2f}x the device's busy "
              f"time (each step synchronised: {wall / busy:.2f}x)")
    print(f"{'ms/step':>9s} {'share':>6s} {'calls':>5s}  kernel")
    for name, (ms, calls) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{ms:9.3f} {ms / max(total, 1e-9):6.1%} {calls // args.steps:5d}  {name[:150]}")
    sort_key = "self_device_time_total" if GPU else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort_key, row_limit=args.top, max_name_column_width=70))
    if args.gaps:
        launched_in = launch_contexts(prof.events())
        idle = idle_between([(e.time_range.start, e.time_range.end, f"{e.name[:60]} [{launched_in(e)}]")
                             for e in kernels])
        print(f"device idle between kernels: {sum(idle.values()) / 1e3 / args.steps:.3f} ms/step (with the host's "
              f"time from one step's last launch to the next step's first)")
        print(f"{'ms/step':>9s}  after kernel [launched in] -> before kernel [launched in]")
        for (after, before), us in sorted(idle.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"{us / 1e3 / args.steps:9.3f}  {after}\n{'':11s}-> {before}")
    if args.cprofile:
        host_profile(step, args.steps, args.top)
    if args.host_parts:
        parts = host_parts(step.layer, step, args.steps)
        print(f"host: {sum(parts.values()):.3f} ms/step in the layer's parts and autograd nodes (wall {wall:.3f})")
        for name, ms in parts.items():
            print(f"{ms:9.3f}  {name}")


def launch_contexts(events):
    """kernel event -> where the host launched it: the ranges around its launch call on the host (the runtime
    event of the same correlation id), innermost first, up to three (the op, and e.g. the autograd node or
    module range around it)."""
    runtime = {e.id: e for e in events if e.device_type == torch.autograd.DeviceType.CPU
               and e.name.startswith(("cuda", "cu", "hip")) and not e.name.startswith("cudnn")}

    def context(kernel) -> str:
        launch, names = runtime.get(kernel.id), []
        event = launch.cpu_parent if launch is not None else None
        while event is not None and len(names) < 3:
            names.append(event.name.replace(NODE, "backward of ")[:50])
            event = event.cpu_parent
        return " < ".join(names) or ("?" if launch is None else launch.name)
    return context


def gemm_tuning(text: str) -> dict[str, int]:
    """``--gemm-tuning``'s ``key=value,...`` -> a dict of integers; each key one of ``GEMM_TUNING``'s."""
    from megatron_zaya.kernels.grouped_gemm import GEMM_TUNING

    pairs = dict(item.split("=", 1) for item in text.split(",") if item)
    unknown = sorted(set(pairs) - set(GEMM_TUNING["cuda"]))
    if unknown:
        raise argparse.ArgumentTypeError(f"not in GEMM_TUNING: {', '.join(unknown)}")
    return {key: int(value) for key, value in pairs.items()}


def within(context, step):
    """``step`` run within ``context()``: a launch path other than the default, as a baseline."""
    def baseline():
        with context():
            step()
    return baseline


def in_turns(step, baseline, rounds: int) -> tuple[float, float]:
    """Median wall ms per step of ``step`` and of ``baseline``, timed in alternating rounds after a warm-up each."""
    times = {step: [], baseline: []}
    for fn in times:
        call_times(fn, warmup=3, iters=0)
    for _ in range(rounds):
        for fn in (baseline, step):
            times[fn] += call_times(fn, warmup=1, iters=10)
    return statistics.median(times[step]), statistics.median(times[baseline])


def host_profile(step, steps: int, top: int) -> None:
    """Python functions by own and cumulative host time, ms per step."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    if GPU:
        torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler)
    total = sum(entry[2] for entry in stats.stats.values())  # own time of every function
    print(f"host: {1e3 * total / steps:.3f} ms/step of Python and C calls under cProfile")
    for key in ("tottime", "cumulative"):
        print(f"{'own ms' if key == 'tottime' else 'cum ms':>9s} {'calls':>6s}  function  (sorted by {key})")
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2 if key == "tottime" else 3])[:top]
        for (path, line, name), (_, calls, own, cumulative, _) in rows:
            ms = (own if key == "tottime" else cumulative) * 1e3 / steps
            print(f"{ms:9.3f} {calls // steps:6d}  {name} ({path.split('site-packages/')[-1][-60:]}:{line})")


if __name__ == "__main__":
    main()
