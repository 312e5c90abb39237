"""The experts' grouped GEMM by ``torch._grouped_mm`` (the vendor's grouped GEMM, through torch), GEMM by GEMM
beside the Triton kernel (``kernels/grouped_gemm.py``), and which of the two runs each GEMM on a platform.

A grouped GEMM call (the contract of ``ops.experts.grouped_gemm``) is three GEMMs: the ``forward``
``out[rows of e] = x[rows of e] @ weight[e].T``, the ``input_grad`` ``d x[rows of e] = d out[rows of e] @ weight[e]``
and the ``weight_grad`` ``d weight[e] = d out[rows of e].T @ x[rows of e]``. :class:`Backends` names the backend
of each, ``"triton"`` or ``"torch"``; :func:`grouped_gemm` runs a call with any mix, under the kernel's contract:

- the experts' weights are read where they are: E [M, K] tensors at one stride in memory (Megatron's buffers)
  are viewed as [E, M, K] (others are stacked, one copy per call), so parameters and checkpoints stay
  ``SequentialMLP``'s;
- rows past the routed ones (``padded_rows``) are zero in the output and the input gradient (``torch._grouped_mm``
  leaves them unwritten: they are filled after it);
- x's rows or the output's may be in token order instead (a composite op's call, :class:`TokenOrder`): the row-tile
  kernel reads x and writes the output (and x's gradient) through the sort's order; ``torch._grouped_mm``, which
  cannot, and the weight gradient get their rows permuted by ``index_select`` (in the backward: no sorted copy is
  kept for it);
- the weight gradients of experts under Megatron's DDP go into their ``main_grad`` from inside the backward
  (``kernels.grouped_gemm.main_grad_target`` decides when): the Triton kernel adds them there in fp32, while
  ``torch._grouped_mm`` returns them in the inputs' dtype (its output dtype is theirs), and one foreach addition
  adds that bf16 gradient, as Megatron's own hooks add an unfused layer's.

``torch._grouped_mm`` takes int32 cumulative row offsets; on CUDA it wants bf16 operands whose strides are
multiples of 16 bytes, and its weight-gradient form (two 2-D operands) groups along the contraction. It runs
without a host sync (CUDA graphs capture it) only where torch has a grouped kernel for the GPU (sm_90 and sm_100
in bf16; ROCm builds with CK on gfx942/gfx950): :func:`available` checks that.

The choice. ``benchmarks/grouped_gemm_backends.py`` times both backends for each GEMM at a model's weight shapes
on a GPU and writes the faster one into :data:`TABLE_PATH`, each entry with its GPU, torch and Triton versions,
command and date. :func:`choose_backends` reads it when the model is built (``ops.experts.choose_backends``). A GPU
without an entry, or a torch without ``_grouped_mm`` for the device and dtype (:func:`available`), keeps the
Triton kernel for every GEMM.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

GEMMS = ("forward", "input_grad", "weight_grad")
BACKENDS = ("triton", "torch")
#: The measured choices: ``{"about": ..., "entries": [{"device", "dtype", "weight": [E, M, K], "matrix",
#: "backends": {gemm: backend}, "ms": {gemm: {backend: ms}}, "tokens", "torch", "triton", "command", "date"}]}``.
TABLE_PATH = Path(__file__).with_name("grouped_mm_table.json")


class Backends(NamedTuple):
    """The backend of each GEMM of one grouped GEMM call."""

    forward: str = "triton"
    input_grad: str = "triton"
    weight_grad: str = "triton"


TRITON = Backends()


@functools.cache
def available(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch runs ``torch._grouped_mm`` on ``device_type`` (``cuda``: the current GPU, CUDA or ROCm)
    in ``dtype``, on a GPU without a host sync: a two-group call on small aligned operands, under
    ``torch.cuda.set_sync_debug_mode("error")``, checked against a matmul. (On GPUs where torch has no grouped
    kernel, e.g. CUDA before sm_90, it falls back to a loop that reads the offsets on the host, which would stall
    every MoE layer and break CUDA graphs.) Exact small integers as values: the check draws no random numbers."""
    if not hasattr(torch, "_grouped_mm") or (device_type == "cuda" and not torch.cuda.is_available()):
        return False
    x = (torch.arange(32 * 16, device=device_type) % 7 - 3).view(32, 16).to(dtype)
    w = (torch.arange(2 * 16 * 16, device=device_type) % 5 - 2).view(2, 16, 16).to(dtype)
    offsets = torch.tensor([16, 32], dtype=torch.int32, device=device_type)
    on_gpu = device_type == "cuda"
    sync_mode = torch.cuda.get_sync_debug_mode() if on_gpu else None
    try:
        if on_gpu:
            torch.cuda.set_sync_debug_mode("error")
        out = torch._grouped_mm(x, w, offs=offsets)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    finally:
        if on_gpu:
            torch.cuda.set_sync_debug_mode(sync_mode)
    return torch.equal(out.float(), torch.cat([x[:16].float() @ w[0].float(), x[16:].float() @ w[1].float()]))


def device_name() -> str:
    """The name table entries are keyed by: the current GPU's (``NVIDIA H200``), or ``cpu``."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def read_table(path: Path = TABLE_PATH) -> list[dict]:
    """The table's entries."""
    return json.loads(path.read_text())["entries"]


def lookup(entries: list[dict], device: str, dtype: torch.dtype, weight_shape) -> Backends:
    """The backends measured for ``device``, ``dtype`` and experts' weights of ``weight_shape`` [E, M, K]; the
    Triton kernel for every GEMM where nothing was measured."""
    for entry in entries:
        if (entry["device"], entry["dtype"], list(entry["weight"])) == (device, dtype_name(dtype), list(weight_shape)):
            return Backends(**entry["backends"])
    return TRITON


def dtype_name(dtype: torch.dtype) -> str:
    """How the table names a dtype: ``bfloat16``."""
    return str(dtype).removeprefix("torch.")


def choose_backends(dtype: torch.dtype, weight_shapes) -> list[Backends]:
    """The backends of each of ``weight_shapes`` ([E, M, K] each) on this machine's GPU, from the table; torch's
    only where :func:`available`."""
    device = device_name()
    if device == "cpu":
        return [TRITON for _ in weight_shapes]
    entries = read_table()
    chosen = [lookup(entries, device, dtype, shape) for shape in weight_shapes]
    if any(backends != TRITON for backends in chosen) and not available("cuda", dtype):
        return [TRITON for _ in weight_shapes]
    return chosen


def runs_on(x: torch.Tensor, weights, backends: Backends) -> bool:
    """Whether ``backends`` can run on these operands: ``torch._grouped_mm`` available for their device and dtype,
    rows of both operands multiples of 16 bytes, and the Triton kernel running where it has a GEMM."""
    m_dim, k_dim = weights[0].shape[-2:]
    if not available(x.device.type, x.dtype) or (m_dim * x.element_size()) % 16 or (k_dim * x.element_size()) % 16:
        return False
    return "triton" not in backends or _kernel().runs_on(x, *weights)


def grouped_gemm(x: torch.Tensor, weight, tokens_per_expert: torch.Tensor, padded_rows: bool = False,
                 backends: Backends = TRITON) -> torch.Tensor:
    """``ops.experts.grouped_gemm`` with each GEMM by its backend in ``backends`` (check :func:`runs_on` first)."""
    function, arguments = autograd_call(x, weight, tokens_per_expert, padded_rows, backends)
    return function.apply(*arguments)


class TokenOrder(NamedTuple):
    """Rows in token order around a grouped GEMM over rows sorted by expert (``sort_by_expert``): sorted row i is
    token ``order[i]``, token t is sorted row ``inverse[t]``."""

    order: torch.Tensor
    inverse: torch.Tensor


def autograd_call(x: torch.Tensor, weight, tokens_per_expert: torch.Tensor, padded_rows: bool, backends: Backends,
                  x_order: TokenOrder | None = None, out_order: TokenOrder | None = None):
    """The autograd Function of :func:`grouped_gemm` and its arguments, checked (the kernel's ``prepare``): the
    kernel's own where every GEMM is Triton's on rows sorted by expert, else :class:`GroupedMM`. A composite op runs
    them itself; given ``x_order`` or ``out_order``, x's rows or the output's (and so their gradients') are in token
    order."""
    kernel = _kernel()
    x, counts, padded_rows, table, *weights = kernel.prepare(x, weight, tokens_per_expert, padded_rows)
    if backends == TRITON and x_order is None and out_order is None:
        return kernel.GroupedGemm, (x, counts, padded_rows, table, *weights)
    return GroupedMM, (x, counts, padded_rows, table, backends, x_order, out_order, *weights)


def _kernel():
    from ..kernels import grouped_gemm as kernel  # imported when first called: triton only where it runs

    return kernel


class GroupedMM(torch.autograd.Function):
    """``(x, counts, padded_rows, table, backends, x_order, out_order, *weights)``: the kernel's arguments (its
    ``prepare``), the backends, and the :class:`TokenOrder` of x's rows and of the output's where they are in token
    order (else None). The row-tile kernel reads and writes rows in token order through the order; for
    ``torch._grouped_mm`` and the weight gradient they are permuted by ``index_select`` (:func:`_sorted`)."""

    @staticmethod
    def forward(ctx, x, counts, padded_rows, table, backends, x_order, out_order, *weights):
        kernel = _kernel()
        offsets, tail = row_offsets(counts, x.shape[0], padded_rows) if "torch" in backends else (None, None)
        if backends.forward == "torch":
            out = _unsorted(torch_forward(_sorted(x, x_order), weights, offsets, tail), out_order)
        else:
            out = kernel.matmul(x, counts, padded_rows, table, weights, True, _order(x_order), _order(out_order))
        ctx.save_for_backward(x, counts, offsets, tail)  # x as given: no sorted copy kept
        ctx.padded_rows, ctx.table, ctx.backends, ctx.weights = padded_rows, table, backends, weights
        ctx.orders = x_order, out_order
        ctx.main_grads = kernel.main_grad_target(weights)  # decided in the forward, for both backends
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, counts, offsets, tail = ctx.saved_tensors
        kernel, backends, weights, (x_order, out_order) = _kernel(), ctx.backends, ctx.weights, ctx.orders
        grad_out = _sorted(grad_out.contiguous(), out_order)  # as the weight gradient reads it: sorted once
        if backends.input_grad == "torch":
            grad_x = _unsorted(torch_input_grad(grad_out, weights, offsets, tail), x_order)
        else:
            grad_x = kernel.matmul(grad_out, counts, ctx.padded_rows, ctx.table, weights, False, None, _order(x_order))
        x = _sorted(x, x_order)
        if backends.weight_grad == "torch":
            grad_w = torch_weight_grad(grad_out, x, offsets, weights, ctx.main_grads is not None)
        else:
            grad_w = kernel.weight_grad(grad_out, x, counts, ctx.padded_rows, weights, ctx.main_grads)
        return grad_x, *(None,) * 6, *kernel.per_weight(grad_w, weights)


def _sorted(tensor: torch.Tensor, order: TokenOrder | None) -> torch.Tensor:
    """Rows in token order (where ``order`` is given) sorted by expert, for a GEMM that cannot gather them."""
    return tensor if order is None else tensor.index_select(0, order.order)


def _unsorted(out: torch.Tensor, order: TokenOrder | None) -> torch.Tensor:
    """The output of a GEMM on ``torch._grouped_mm``, sorted by expert, in token order where ``order`` is given."""
    return out if order is None else out.index_select(0, order.inverse)


def _order(order: TokenOrder | None) -> torch.Tensor | None:
    """The Triton kernel's row table of rows in token order: the sort's order."""
    return None if order is None else order.order


def torch_forward(x, weights, offsets, tail) -> torch.Tensor:
    """``out[rows of e] = x[rows of e] @ weight[e].T`` by ``torch._grouped_mm``; offsets, tail: :func:`row_offsets`."""
    return _zero_tail(torch._grouped_mm(x, stacked(weights).transpose(1, 2), offs=offsets), tail)


def torch_input_grad(grad_out, weights, offsets, tail) -> torch.Tensor:
    """``d x[rows of e] = d out[rows of e] @ weight[e]`` by ``torch._grouped_mm``."""
    return _zero_tail(torch._grouped_mm(grad_out, stacked(weights), offs=offsets), tail)


def torch_weight_grad(grad_out, x, offsets, weights, into_main_grad: bool) -> torch.Tensor:
    """``d weight[e] = d out[rows of e].T @ x[rows of e]`` by ``torch._grouped_mm`` (rows past the offsets left
    out) as [E, M, K]; ``into_main_grad``: added to each weight's ``main_grad`` (one foreach addition), the weights
    marked as Megatron's hooks expect, and the returned tensor then ignored, as the kernel's placeholder is."""
    grad_w = torch._grouped_mm(grad_out.t(), x, offs=offsets)
    if into_main_grad:
        torch._foreach_add_([w.main_grad for w in weights], list(grad_w.unbind(0)))
        for weight in weights:
            weight.grad_added_to_main_grad = True
    return grad_w


def _zero_tail(out: torch.Tensor, tail: torch.Tensor | None) -> torch.Tensor:
    """The rows past the last offset, which ``torch._grouped_mm`` leaves unwritten, zero."""
    return out if tail is None else out.masked_fill_(tail, 0)


_OFFSETS = WeakIdKeyDictionary()  # counts tensor -> {(rows, padded_rows): (offsets, tail)}


def row_offsets(counts: torch.Tensor, n_rows: int, padded_rows: bool):
    """int32 cumulative row offsets of the experts, and with ``padded_rows`` a [N, 1] mask of the rows past them;
    built once per counts tensor (a layer's GEMMs share it; counts are never changed in place)."""
    built = _OFFSETS.setdefault(counts, {})
    if (n_rows, padded_rows) not in built:
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        tail = (torch.arange(n_rows, device=counts.device) >= offsets[-1]).unsqueeze(1) if padded_rows else None
        built[n_rows, padded_rows] = offsets, tail
    return built[n_rows, padded_rows]


def stacked(weights) -> torch.Tensor:
    """The experts' weights as one [E, M, K] tensor: the stacked one given; a view of E contiguous [M, K] tensors
    of one storage at one positive stride, a multiple of 16 bytes (as a buffer may hold them); else a stacked copy."""
    first = weights[0]
    if len(weights) == 1:
        return first
    size, step = first.element_size(), weights[1].data_ptr() - first.data_ptr()
    in_place = (step >= first.numel() * size and step % 16 == 0 and first.data_ptr() % 16 == 0
                and all(w.is_contiguous() and w.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                        and w.data_ptr() - first.data_ptr() == e * step for e, w in enumerate(weights)))
    if in_place:
        return first.as_strided((len(weights), *first.shape), (step // size, first.shape[1], 1))
    return torch.stack(weights)
