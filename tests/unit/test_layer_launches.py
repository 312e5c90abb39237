"""The launches of one ZAYA1 layer's training step as trained, counted on CPU: the eager layer is host-bound, so
each launch is host time. (That the step never waits for the device is checked on a GPU, in
tests/gpu/test_host_sync_gpu.py: on CPU the grouped GEMM also reads its counts to check them.)

The layer as the CLI trains it on a GPU (every kernel op, Megatron's DDP adding gradients into ``main_grad``,
the default selective recomputation), its Triton kernels run by the interpreter. Counted under a
``TorchDispatchMode``: every torch op that launches a kernel on a GPU (views, allocations and metadata launch
none), and every Triton launch (the torch work inside the interpreter left out). The budget is the count when
the ``moe`` op took the merge and norm before it (the router head adding the projection's bias and the counts, the
sort writing the gates, the grouped GEMM kernels reading x and writing y in token order), the CCA backward finished
its parameters' gradients in kernels, and the ``cca_sublayer`` op took the value delay as a kernel, q and k
recomputed in place and q0's gradients summed by a kernel (82 with torch 2.14, 83 since the router head sums its
weight gradients over slices of tokens, 82 since the CCA op's norm backward adds the stream's gradient from the
rest of the layer, 80 since the test's own two launches are left out: the output's gradient of ones, and the input's
gradient added to the last step's, 77 since the sublayer ops add the input's gradients by their GEMMs; 182 before
the sort by expert and the row-tile table became kernels, 146 before the ``moe`` op, 117 before the ``cca_sublayer``
op, 111 before these cuts), with room for another torch's decompositions; lower it as launches are cut.

The host's other work per op is autograd's: a graph node each, with its saved tensors. The nodes of the layer's
graph (parameters' gradient accumulators left out) are counted too: 35 with the kernels op by op, 26 with the MoE
sublayer as one op, 13 with the CCA sublayer's pre-attention part as one op too, 12 with the merge and norm before
the MoE sublayer in its op. So are the parameters left on the graph, each with a gradient accumulator node and a
DDP hook: 6 of the layer's 40, since the sublayer ops hand theirs to DDP themselves (the
``training_loop.gradient_ready_calls`` patch).
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton_interpreter import install_model_kernels

from megatron_zaya.config import KERNEL_OPS, zaya_config
from megatron_zaya.pretrained import build_single_process_model

LAUNCH_BUDGET = 80
NODE_BUDGET = 12
ON_GRAPH_BUDGET = 6  # of the layer's 40 parameters: those whose gradients autograd hands to DDP's hooks
# Ops that launch no kernel on a GPU: views, allocations, metadata.
NO_LAUNCH = {"view", "_unsafe_view", "as_strided", "t", "transpose", "permute", "expand", "slice", "select",
             "unsqueeze", "squeeze", "detach", "alias", "split", "split_with_sizes", "chunk", "unbind", "narrow",
             "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_reshape_alias",
             "lift_fresh", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
             "_has_compatible_shallow_copy_type", "set_", "resize_", "unflatten", "view_as", "expand_as",
             "unsafe_split", "_to_copy_meta", "diagonal", "movedim", "flatten", "reshape", "contiguous"}


class LaunchCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.paused = Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and name not in NO_LAUNCH:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def test_one_layer_step_as_trained_launches_within_budget(monkeypatch, model_kernels):
    counter = LaunchCounter()
    triton_launches = Counter()

    @contextlib.contextmanager
    def counted(module_name, kernel_name):  # the torch work inside the interpreter is not a launch
        triton_launches[kernel_name] += 1
        counter.paused += 1
        try:
            yield
        finally:
            counter.paused -= 1

    install_model_kernels(monkeypatch, model_kernels, counted)
    # whole slices of tokens for the router head's weight gradients, as at training's token counts
    monkeypatch.setitem(model_kernels["router"].ROUTER_HEAD_TUNING["cpu"], "wgrad_slice", 16)

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    cfg = zaya_config("test", num_layers=1, kernels=",".join(KERNEL_OPS), use_cpu_initialization=True,
                      params_dtype=torch.float32, recompute_granularity="selective")
    model = build_single_process_model(cfg).train()
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    layer = model.decoder.layers[0]
    ddp_hooked = sum(1 for _ in layer.parameters())
    seq, batch = 32, 2
    rotary = model.rotary_pos_emb["global"](seq)
    x = torch.randn(seq, batch, cfg.hidden_size, generator=torch.Generator().manual_seed(0), requires_grad=True)
    grad = torch.ones_like(x)

    graph_nodes = Counter()

    def step():
        x.grad = None  # the stream's gradient is kept, not added to the last step's: no launch of the test's own
        out, _ = layer(x, rotary_pos_emb=rotary)
        graph_nodes.clear()
        graph_nodes.update(_graph_nodes(out.grad_fn))
        out.backward(grad)

    step()  # first calls: caches (offset tables), lazily built state
    triton_launches.clear()
    with counter:
        step()
    launches = sum(counter.ops.values()) + sum(triton_launches.values())
    assert ddp is not None  # its gradient hooks live as long as it does
    assert launches <= LAUNCH_BUDGET, (launches, counter.ops.most_common(), triton_launches)
    assert sum(graph_nodes.values()) - graph_nodes["AccumulateGrad"] <= NODE_BUDGET, graph_nodes.most_common()
    assert graph_nodes["AccumulateGrad"] <= ON_GRAPH_BUDGET, (graph_nodes["AccumulateGrad"], ddp_hooked)


def _graph_nodes(root) -> Counter:
    """The autograd nodes reachable from ``root`` by kind (a parameter on the graph: its ``AccumulateGrad``)."""
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(following for following, _ in node.next_functions)
    return Counter(type(node).__name__ for node in seen)
