"""The ZAYA1 layers' forward and backward passes replayed as CUDA graphs (``--zaya-cuda-graphs``).

Why: one ZAYA1-8B-width layer launches ~420 kernels for ~6 ms of H200 work and the host needs ~11 ms to launch
them (``benchmarks/profile_layer.py``), so a training step runs at the host's pace, not the GPU's. A replayed
graph is one launch. Megatron's own graphs (``--cuda-graph-impl``) capture ``TransformerLayer``'s signature
and need static token counts, which dropless MoE does not have; a ZAYA1 layer on one expert- and
tensor-parallel rank does (``ZayaMoELayer``'s local dispatch into a static-size buffer, the grouped-GEMM
experts of the ``experts`` kernel op), with no host sync, so the whole layer can be captured.

How: the first training forward with a new input signature (shapes, dtypes) runs two warm-up passes of the
block's layers on a side stream (kernel compilation, library workspaces), then captures for every layer a
forward graph and a backward graph in the order they will replay (forwards in layer order, backwards in
reverse), in one memory pool. Layer i+1's static inputs *are* layer i's static outputs, and layer i's
backward reads its output gradients where layer i+1's backward wrote its input gradients, so a replay copies
only what enters the block. Each layer is one autograd node whose backward replays its graph. Under Megatron's
DDP the graph also adds each parameter gradient to its ``main_grad`` (what DDP's gradient hook would do after
the replay: the same addition, so the same bits). With DDP's ready calls (the ``training_loop.gradient_ready_calls``
patch) those parameters stay off autograd's graph and the node makes their ready calls itself (overlapped
reduction): no gradient tensor, accumulator node or hook per parameter. Without them the node hands autograd empty
placeholders, as Megatron's own gradient-accumulation fusion does: the hooks then skip the addition and only do
their bookkeeping. Handing autograd the graph's own gradient tensors instead would make it
copy each one before the hook adds it, two kernels per parameter outside the graph (64 parameters per layer,
every micro-batch). The graph's gradient tensors of such parameters are dropped once captured: the graphs
captured after it reuse their memory (one layer's gradients in the pool, not every layer's). Without
``main_grad`` (no DDP) the gradients go to autograd as in eager mode. Evaluation and no-grad forwards run
eagerly.

A replay repeats the kernels, not the Python: what a layer's forward does to state outside its tensors is not
redone, and module hooks do not run. The one such effect in ZAYA1 is the router's in-place token count, which
is a kernel and replays. Hence the limits, checked when the block is built (one-line errors): one pipeline
stage (a stage's graphs hold one micro-batch's activations, 1F1B interleaves several), context parallel 1 (halo
exchanges), every expert local (EP = TP = 1), no full recomputation (selective recomputation runs inside the
captured forward and backward: ``recompute.py``), no dropout (RNG offsets), and the grouped experts.
``--overlap-param-gather`` is refused by the CLI: its forward pre-hooks on modules would not
run. A hook that keeps tensors from call to call (a global forward hook, a probe) must skip calls made while
``torch.cuda.is_current_stream_capturing()``: the graph would read tensors the hook later drops.

A capture the platform refuses (on ROCm, collectives and torch's NCCL watchdog break HIP graph capture) is not
fatal: that input signature runs eagerly from then on, after one ``[zaya]`` warning line, and the allocator no
longer routes to the graphs' pool (:func:`_end_routing_to`).

Off: the default; leave out ``--zaya-cuda-graphs`` (``ZayaConfig.cuda_graphs=False``).
"""

from __future__ import annotations

import sys
import warnings
from contextlib import contextmanager
from functools import partial

import torch

from ..config import ZayaConfigError
from ..ops import experts
from ..runtime import print_rank_0

WARMUP_PASSES = 2
MASK = "attention_mask"  # among the constants, next to the RoPE tables keyed by attention type


def check_cuda_graphs(block) -> None:
    """One-line errors for a ``ZayaTransformerBlock`` whose layers cannot be captured (see the module docstring)."""
    groups = block.pg_collection
    problems = [
        (groups.pp.size() > 1, "pipeline parallelism", "use --pipeline-model-parallel-size 1"),
        (groups.cp.size() > 1, "context parallelism", "use --context-parallel-size 1"),
        (not all(layer.mlp._dispatches_locally() for layer in block.layers), "experts spread over ranks",
         "use --expert-model-parallel-size 1 and --tensor-model-parallel-size 1"),
        (not torch.cuda.is_available(), "no CUDA/ROCm device", "run on a GPU"),
        (not all(layer.mlp.experts.grouped for layer in block.layers), "the experts' per-expert loop (a host sync)",
         "select the experts kernel (--zaya-kernels all, or a list with experts)"),
    ]
    for failed, problem, fix in problems:
        if failed:
            raise ZayaConfigError(f"--zaya-cuda-graphs with {problem}: {fix}, or drop --zaya-cuda-graphs")


class _CapturedLayer:
    """One layer's static tensors and its forward and backward graphs."""

    def __init__(self, layer, inputs: list[torch.Tensor]):
        self.layer = layer
        self.inputs = inputs  # hidden [, router state]
        self.params = tuple(p for p in layer.parameters() if p.requires_grad)
        self.forward_graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.grad_outputs: list[torch.Tensor] = []
        self.grads: tuple[torch.Tensor | None, ...] = ()  # of inputs, then of params
        # Per parameter of ``params``: whether the backward graph adds its gradient to Megatron's main_grad (the
        # grouped experts' kernel, or the graph's own addition); a replay does not rerun the Python that tells
        # Megatron's hooks so.
        self.in_main_grad: list[bool] = []
        # Those of them with DDP's ready call (``training_loop.gradient_ready_calls``) stay off autograd's graph:
        # the replay makes the call. The others are the node's inputs after ``inputs``.
        self.handed: list[bool] = []
        self.on_graph: tuple[torch.Tensor, ...] = self.params


class _ReplayLayer(torch.autograd.Function):
    """Autograd node of one captured layer: ``(captured, *inputs, *params) -> outputs``."""

    @staticmethod
    def forward(ctx, captured: _CapturedLayer, *tensors):
        for static, given in zip(captured.inputs, tensors):
            _load(static, given)
        captured.forward_graph.replay()
        ctx.captured = captured
        ctx.set_materialize_grads(False)
        return tuple(out.detach() for out in captured.outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        captured = ctx.captured
        for static, given in zip(captured.grad_outputs, grad_outputs):
            if given is None:  # an output nothing used (the last layer's router state)
                static.zero_()
            else:
                _load(static, given)
        captured.backward_graph.replay()
        inputs = len(captured.inputs)
        param_grads = []
        for param, grad, in_main, handed in zip(captured.params, captured.grads[inputs:], captured.in_main_grad,
                                                captured.handed):
            if handed:
                param.ddp_grad_ready()
                continue
            if in_main:  # a fresh placeholder, which autograd takes as it is; the graph's own tensor it would copy
                param.grad_added_to_main_grad = True
                grad = torch.empty_like(param)
            param_grads.append(grad)
        return (None, *captured.grads[:inputs], *param_grads)


def _load(static: torch.Tensor, given: torch.Tensor) -> None:
    """Copy ``given`` into the static buffer unless it already is that buffer (chained layers)."""
    if given.data_ptr() != static.data_ptr():
        static.copy_(given)


@contextmanager
def _flags_cleared(params):
    """Megatron's ``grad_added_to_main_grad`` off during a backward capture and restored after it: what sets it
    there (the grouped experts' kernel) is told apart from replays earlier in the step."""
    saved = [getattr(p, "grad_added_to_main_grad", None) for p in params]
    for param, flag in zip(params, saved):
        if flag is not None:
            param.grad_added_to_main_grad = False
    try:
        yield
    finally:
        for param, flag in zip(params, saved):
            if flag is not None:
                param.grad_added_to_main_grad = flag


def _add_to_main_grads(params, grads) -> list[bool]:
    """Captured in a backward graph: each gradient added to its Megatron ``main_grad`` (DDP's hook's addition).
    Returns, per parameter, whether its gradient is then in ``main_grad`` (the experts' own included)."""
    in_main_grad = []
    for param, grad in zip(params, grads):
        added_by_kernel = getattr(param, "grad_added_to_main_grad", False)
        add_here = not added_by_kernel and grad is not None and getattr(param, "main_grad", None) is not None \
            and hasattr(param, "grad_added_to_main_grad")
        if add_here:
            param.main_grad.add_(grad)
        in_main_grad.append(added_by_kernel or add_here)
    return in_main_grad


@contextmanager
def _step_untouched(layers):
    """Warm-up passes must not add to the routers' token counts of this step, nor to the gradients (the grouped
    experts' kernel and Megatron's gradient-accumulation fusion add to ``main_grad`` from inside a backward)."""
    routers = [layer.mlp.router for layer in layers]
    fused_linears = [m for layer in layers for m in layer.modules() if getattr(m, "gradient_accumulation_fusion", 0)]
    for router in routers:
        router.count_tokens = False
    for linear in fused_linears:
        linear.gradient_accumulation_fusion = False
    try:
        with experts.main_grad_untouched():
            yield
    finally:
        for linear in fused_linears:
            linear.gradient_accumulation_fusion = True
        for router in routers:
            router.count_tokens = True


def _end_routing_to(pool) -> None:
    """After a failed capture: the caching allocator stops routing allocations to the graphs' pool, and the failed
    graph's hold on the pool goes. Some torch releases end the routing in ``CUDAGraph.capture_end`` only once the
    stream's capture ended without error, so a failed capture left it on: the allocator's next ``empty_cache`` (the one
    each capture starts with too, and the release before an out-of-memory retry) then fails an internal assert that
    aborts the process, as at exit when a ``MemPool`` is freed. Where torch ended it, nothing is left to do."""
    device = torch.cuda.current_device()
    try:
        torch._C._cuda_endAllocateToPool(device, pool)
    except RuntimeError:  # not routing to the pool: torch ended it, or the capture never began
        return
    torch._C._cuda_releasePool(device, pool)


def _leave_capture_mode() -> None:
    """After a failed capture: this GPU's default random generator leaves capture mode. Torch ends it in
    ``CUDAGraph.capture_end`` only once the stream's capture ended without error, so a failed capture left it on, and
    every later random op outside a capture (``torch.randn`` on the GPU, a dropout) raised "Offset increment outside
    graph capture encountered unexpectedly". A clone of its state (same seed and offset, not capturing) replaces it."""
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    generator.graphsafe_set_state(generator.clone_state())


def _first_error(error: BaseException) -> BaseException:
    """The error a failed capture began with. Ending a capture that an earlier call invalidated raises an error of
    its own ("operation failed due to a previous error during capture"), chained to the one that says why."""
    while isinstance(error.__context__, RuntimeError) and not error.__suppress_context__:
        error = error.__context__
    return error


class LayerGraphs:
    """``LayerGraphs(layers)(hidden, router_state, attention_mask, rotary_pos_emb) -> (hidden, router_state)``:
    the layers run in order, each as the replay of its captured graphs (one capture per input signature).
    Returns None where the signature's capture failed: the caller runs the layers eagerly."""

    def __init__(self, layers):
        self.layers = list(layers)
        # None for a signature whose capture failed
        self._chains: dict[tuple, tuple[list[_CapturedLayer], dict[str, torch.Tensor]] | None] = {}

    def __call__(self, hidden, router_state, attention_mask, rotary_pos_emb: dict):
        # Per-step constants of every layer (RoPE tables, the mask when the data loader makes one): copied into
        # the captured buffers when the caller passes other tensors.
        constants = dict(rotary_pos_emb) if attention_mask is None else {**rotary_pos_emb, MASK: attention_mask}
        key = tuple((name, t.shape, t.dtype) for name, t in
                    [("hidden", hidden), ("router_state", router_state), *sorted(constants.items())] if t is not None)
        if key not in self._chains:
            with warnings.catch_warnings():
                # Megatron's gradient hooks hold the parameters' AccumulateGrad nodes, made on the default stream,
                # and torch warns when a backward pass on another stream reaches them. Only warm-up and capture
                # do (on side streams, by design); replays run on the caller's stream.
                warnings.filterwarnings("ignore", message="The AccumulateGrad node's stream does not match")
                self._chains[key] = self._capture_or_none(hidden, router_state, constants)
        if self._chains[key] is None:
            return None
        chain, static_constants = self._chains[key]
        for name, given in constants.items():
            _load(static_constants[name], given)
        for captured in chain:
            inputs = (hidden,) if len(captured.inputs) == 1 else (hidden, router_state)
            hidden, router_state = _ReplayLayer.apply(captured, *inputs, *captured.on_graph)
        return hidden, router_state

    @property
    def captured_signatures(self) -> int:
        """How many input signatures replay as graphs (a failed capture's signature runs eagerly)."""
        return sum(chain is not None for chain in self._chains.values())

    def _capture_or_none(self, hidden, router_state, constants):
        try:
            chain = self._capture(hidden, router_state, constants)
        except RuntimeError as error:
            torch.cuda.synchronize()
            cause = _first_error(error)
            line = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:160]
            print_rank_0(f"[zaya] warning: CUDA graph capture failed ({line}); these layers run eagerly",
                         file=sys.stderr)
            return None
        print_rank_0(f"[zaya] CUDA graphs: captured the forward and backward of {len(self.layers)} layers "
                     f"for input {list(hidden.shape)}", file=sys.stderr)
        return chain

    def _capture(self, hidden, router_state, constants):
        constants = {name: table.detach().clone() for name, table in constants.items()}
        runs = [partial(layer, attention_mask=constants.get(MASK), rotary_pos_emb=constants[layer.attention_type])
                for layer in self.layers]
        first = [hidden.detach().clone().requires_grad_()]
        if router_state is not None:
            first.append(router_state.detach().clone().requires_grad_())

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), _step_untouched(self.layers):
            for _ in range(WARMUP_PASSES):
                self._warm_up(runs, first)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

        pool = torch.cuda.graph_pool_handle()
        try:
            return self._capture_into(pool, runs, first), constants
        except RuntimeError:
            _end_routing_to(pool)
            _leave_capture_mode()
            raise

    def _capture_into(self, pool, runs, first) -> list[_CapturedLayer]:
        chain, inputs = [], first
        for layer, run in zip(self.layers, runs):
            captured = _CapturedLayer(layer, inputs)
            with torch.cuda.graph(captured.forward_graph, pool=pool, capture_error_mode="thread_local"):
                captured.outputs = run(*inputs[:1], router_state=inputs[1] if len(inputs) > 1 else None)
            chain.append(captured)
            inputs = [out.detach().requires_grad_() for out in captured.outputs]

        next_grads: tuple = ()
        for captured in reversed(chain):
            # Chained: where the next layer's backward leaves the gradient of its inputs.
            captured.grad_outputs = [
                next_grads[i] if i < len(next_grads) and next_grads[i] is not None else torch.zeros_like(out)
                for i, out in enumerate(captured.outputs)
            ]
            with _flags_cleared(captured.params), torch.cuda.graph(captured.backward_graph, pool=pool,
                                                                    capture_error_mode="thread_local"):
                grads = torch.autograd.grad(captured.outputs, captured.inputs + list(captured.params),
                                            grad_outputs=captured.grad_outputs, allow_unused=True)
                inputs = len(captured.inputs)
                captured.in_main_grad = _add_to_main_grads(captured.params, grads[inputs:])
            captured.handed = [in_main and hasattr(param, "ddp_grad_ready")
                               for param, in_main in zip(captured.params, captured.in_main_grad)]
            captured.on_graph = tuple(p for p, handed in zip(captured.params, captured.handed) if not handed)
            # A gradient in main_grad is not read after its graph: its memory goes back to the pool, for the
            # graphs captured (and so replayed) after this one, as the layer's other temporaries do.
            captured.grads = (*grads[:inputs], *(None if in_main else grad for grad, in_main
                                                 in zip(grads[inputs:], captured.in_main_grad)))
            del grads
            next_grads = captured.grads[:inputs]
        torch.cuda.synchronize()
        return chain

    def _warm_up(self, runs, first) -> None:
        inputs = [t.detach().requires_grad_() for t in first]
        hidden, router_state = inputs[0], inputs[1] if len(inputs) > 1 else None
        for run in runs:
            hidden, router_state = run(hidden, router_state=router_state)
        params = [p for layer in self.layers for p in layer.parameters() if p.requires_grad]
        torch.autograd.grad((hidden, router_state), inputs + params,
                            grad_outputs=(torch.ones_like(hidden), torch.zeros_like(router_state)),
                            allow_unused=True)

