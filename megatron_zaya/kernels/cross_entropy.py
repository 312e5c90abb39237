"""Cross-entropy over a large vocabulary, alone or fused with the LM head so [T, V] logits never exist.

ZAYA1's vocabulary has V = 262,272 entries (docs/architecture.md §1) and its LM head runs in fp32:
the fp32 logits of 8192 tokens alone take 8.6 GB, their gradient as much again.

* ``cross_entropy(logits [..., V], labels [...]) -> loss [...]`` fp32: two Triton kernels, one pass each
  way. The forward keeps a running max / sum-of-exp per row (online logsumexp) and picks the target
  logit; the backward writes ``(softmax - onehot) * d_loss`` in the logits' dtype.
* ``linear_cross_entropy(hidden [T, D], weight [V, D], labels [T]) -> loss [T]`` fp32: the same kernels
  applied to [token chunk x vocab chunk] tiles of ``hidden @ weight.T``, computed by the vendor GEMM
  (cuBLAS / hipBLASLt) with fp32 output and accumulation from bf16 inputs. The forward merges the
  per-chunk logsumexps; the backward recomputes each tile's logits and accumulates d hidden (fp32) and
  d weight (fp32 per vocab chunk when there are several token chunks) from it. Peak extra memory is one
  tile (fp32 logits + its gradient) and d hidden in fp32.

  When gradients are needed, the forward instead takes whole-vocabulary token chunks and computes the
  gradients with a unit loss gradient right away (3 GEMMs per tile instead of 4: no recomputation). The
  backward scales them: d hidden row by row, which is exact for any loss gradient, and d weight by the one
  factor that Megatron's loss gives every counted token (training/steps.py turns the loss mask into ignored
  labels). Should the loss gradients still differ between tokens (per-token loss weights), d weight is
  recomputed from the saved inputs as above. This holds an fp32 [V, D] d weight from
  forward to backward (2.1 GB at ZAYA1-8B's size), which the backward scales in place, or adds into a given
  tensor (Megatron's ``main_grad``): no second [V, D] tensor.

Labels must lie in [0, V) or equal ``ignore_index`` (loss 0, no gradient). Tensor-parallel vocabularies
(logits split over ranks) are out of scope here: Megatron's ``vocab_parallel_cross_entropy`` stays in use
for TP > 1 (see megatron_zaya/patches/kernels.py). The torch references, the fallback and the choice live in
``ops/lm_head.py``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from .launch import launch
from .utils import cdiv, flat_rows, matmul_fp32, matmul_fp32_into, next_power_of_2, triton_runs

IGNORE_INDEX = -100
BLOCK_V = 4096  # vocab columns per program iteration
TILE_ELEMENTS = 2**28  # logits elements per [token x vocab] tile of linear_cross_entropy: 1 GiB in fp32
#: Logits elements per whole-vocabulary chunk of tokens when the gradients are computed in the forward: 2 GiB in fp32,
#: 2,048 tokens at ZAYA1's vocabulary. Each chunk's weight-gradient GEMM reads and writes the fp32 [V, D] gradient once,
#: so larger chunks amortise it: on an H100 the head took 0.93x the time of 1,024-token chunks, for 1.5 GiB more at
#: its peak (docs/benchmarks.md).
FORWARD_TILE_ELEMENTS = 2**29
#: Token chunks per weight-gradient GEMM when the gradients are computed in the forward: their bf16 logits'
#: gradients are kept side by side (V x 2 bytes per token), so that the fp32 [V, D] gradient is read and written once
#: per group rather than once per chunk. One: on an H100, with chunks of 1,024 tokens, 2 and 4 were 0.98× and 0.97×
#: the time of one for 0.5 and 2.5 GiB more at the peak, within what two runs of one setting differ by; four took
#: 0.95x (a second H100, five rounds) where chunks of twice the tokens took 0.93x (docs/benchmarks.md).
WEIGHT_GRAD_CHUNKS = 1


# ----------------------------------------------------------------------------------------- kernels


@triton.jit(do_not_specialize=["label_offset"])
def _logsumexp_kernel(
    logits_ptr,  # [rows, n_cols] slice of the logits (row stride logits_stride)
    logits_stride,
    labels_ptr,  # [rows] int64
    label_offset,  # vocab index of column 0 of this slice
    n_cols,
    max_ptr,  # [rows] fp32 running max, in/out (-inf before the first slice)
    sum_exp_ptr,  # [rows] fp32 running sum of exp(logit - max), in/out (0 before the first slice)
    target_ptr,  # [rows] fp32 target logit, written by the slice that holds the label
    BLOCK: tl.constexpr,
):
    row = tl.cast(tl.program_id(0), tl.int64)
    row_ptr = logits_ptr + row * logits_stride
    cols = tl.arange(0, BLOCK)
    # One running (max, sum) per row, rescaled once per block: one exp per logit. A running pair per lane
    # needs two (the lane's rescale and the new term), which made this pass bound by the exp units.
    slice_max = tl.full([], float("-inf"), tl.float32)
    slice_sum = tl.zeros([], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        x = tl.load(row_ptr + start + cols, mask=start + cols < n_cols, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(slice_max, tl.max(x, axis=0))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row of only padding so far stays at 0
        slice_sum = slice_sum * tl.exp(slice_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
        slice_max = new_max
    running_max = tl.load(max_ptr + row)
    total_max = tl.maximum(running_max, slice_max)
    total_sum = tl.load(sum_exp_ptr + row) * tl.exp(running_max - total_max)
    total_sum += slice_sum * tl.exp(slice_max - total_max)
    tl.store(max_ptr + row, total_max)
    tl.store(sum_exp_ptr + row, total_sum)
    label = tl.load(labels_ptr + row) - label_offset
    in_slice = (label >= 0) & (label < n_cols)
    target = tl.load(row_ptr + label, mask=in_slice, other=0.0).to(tl.float32)
    tl.store(target_ptr + row, target, mask=in_slice)


@triton.jit(do_not_specialize=["label_offset"])
def _cross_entropy_grad_kernel(
    logits_ptr,  # [rows, n_cols] slice (row stride logits_stride)
    logits_stride,
    labels_ptr,  # [rows] int64
    label_offset,
    lse_ptr,  # [rows] fp32 logsumexp over the whole vocabulary
    grad_loss_ptr,  # [rows] fp32, already 0 for ignored tokens
    grad_ptr,  # [rows, n_cols] output (row stride grad_stride)
    grad_stride,
    n_cols,
    BLOCK: tl.constexpr,
):
    row = tl.cast(tl.program_id(0), tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(logits_ptr + row * logits_stride + cols, mask=mask, other=0.0).to(tl.float32)
    label = tl.load(labels_ptr + row) - label_offset
    grad = tl.exp(x - tl.load(lse_ptr + row)) - (cols == label).to(tl.float32)
    grad *= tl.load(grad_loss_ptr + row)
    tl.store(grad_ptr + row * grad_stride + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)


def _accumulate_logsumexp(logits, labels, label_offset, running_max, running_sum, target):
    launch(_logsumexp_kernel, (logits.shape[0],),
        logits, logits.stride(0), labels, label_offset, logits.shape[1], running_max, running_sum, target,
        BLOCK=min(BLOCK_V, next_power_of_2(logits.shape[1])), num_warps=8,
    )  # fmt: skip


def _softmax_grad(logits, labels, label_offset, lse, grad_loss, out):
    block = min(BLOCK_V, next_power_of_2(logits.shape[1]))
    grid = (logits.shape[0], cdiv(logits.shape[1], block))
    launch(_cross_entropy_grad_kernel, grid, logits, logits.stride(0), labels, label_offset, lse, grad_loss, out,
           out.stride(0), logits.shape[1], BLOCK=block, num_warps=8)  # fmt: skip
    return out


def _new_statistics(rows: int, device: torch.device):
    """(running max = -inf, running sum = 0, target = 0), fp32 [rows] each."""
    return (torch.full((rows,), float("-inf"), device=device), torch.zeros(rows, device=device),
            torch.zeros(rows, device=device))  # fmt: skip


def _loss(running_max, running_sum, target, labels, ignore_index):
    lse = running_max + torch.log(running_sum)
    return torch.where(labels == ignore_index, 0.0, lse - target), lse


# ----------------------------------------------------------------------------------------- cross_entropy


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits2d, labels1d, ignore_index):
        running_max, running_sum, target = _new_statistics(logits2d.shape[0], logits2d.device)
        _accumulate_logsumexp(logits2d, labels1d, 0, running_max, running_sum, target)
        loss, lse = _loss(running_max, running_sum, target, labels1d, ignore_index)
        ctx.save_for_backward(logits2d, labels1d, lse)
        ctx.ignore_index = ignore_index
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits2d, labels1d, lse = ctx.saved_tensors
        grad_loss = torch.where(labels1d == ctx.ignore_index, 0.0, grad_loss.float())
        grad_logits = _softmax_grad(logits2d, labels1d, 0, lse, grad_loss, torch.empty_like(logits2d))
        return grad_logits, None, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Fused per-token cross-entropy; same contract as ``ops.lm_head.cross_entropy``."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {list(logits.shape)} must be labels {list(labels.shape)} + [vocab]")
    loss = _CrossEntropy.apply(flat_rows(logits), labels.reshape(-1).contiguous(), ignore_index)
    return loss.view(labels.shape)


# ----------------------------------------------------------------------------------------- linear_cross_entropy


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    """Split range(n) into equal chunks of at most ``size``."""
    count = cdiv(n, size)
    step = cdiv(n, count)
    return [(start, min(start + step, n)) for start in range(0, n, step)]


def forward_token_chunk(vocab: int) -> int:
    """Tokens per chunk when the gradients are computed in the forward: a power of two near 2^29 / V (2,048 at
    ZAYA1's vocabulary)."""
    return max(1, 2 ** round(math.log2(max(1, FORWARD_TILE_ELEMENTS // vocab))))


def _tiles(tokens: int, vocab: int, token_chunk: int | None, vocab_chunk: int | None):
    token_chunk = token_chunk or min(tokens, 8192)
    vocab_chunk = vocab_chunk or max(256, TILE_ELEMENTS // token_chunk)
    return _chunks(tokens, token_chunk), _chunks(vocab, vocab_chunk)


def _recomputed_grads(hidden, weight, labels, lse, grad_loss, tiles, weight_grad_into=None):
    """(d hidden, d weight) from the saved inputs, recomputing each tile's logits; with ``weight_grad_into``, d weight
    is added into it, chunk by chunk, and None is returned for it."""
    token_ranges, vocab_ranges = tiles
    grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    grad_weight = torch.empty_like(weight) if weight_grad_into is None else None
    # One token chunk writes d weight with one GEMM per vocab chunk; several accumulate it in fp32.
    written = weight_grad_into is None and len(token_ranges) == 1
    for v0, v1 in vocab_ranges:
        w = weight[v0:v1]
        if weight_grad_into is not None:
            grad_w = weight_grad_into[v0:v1]
        else:
            grad_w = grad_weight[v0:v1] if written else torch.zeros(w.shape, device=w.device)
        for t0, t1 in token_ranges:
            h = hidden[t0:t1]
            grad_logits = torch.empty((t1 - t0, v1 - v0), dtype=hidden.dtype, device=hidden.device)
            _softmax_grad(matmul_fp32(h, w.t()), labels[t0:t1], v0, lse[t0:t1], grad_loss[t0:t1], grad_logits)
            matmul_fp32_into(grad_hidden[t0:t1], grad_logits, w, accumulate=True)
            if written:
                torch.mm(grad_logits.t(), h, out=grad_w)
            else:
                matmul_fp32_into(grad_w, grad_logits.t(), h, accumulate=True)
        if grad_weight is not None and not written:
            grad_weight[v0:v1] = grad_w
    return grad_hidden, grad_weight


#: Per GPU: the allocator pool of the forward's temporaries with gradients (the fp32 [V, D] weight gradient held
#: until the backward, each chunk's fp32 [chunk, V] logits and their gradient). In the general cache, other
#: allocations between micro-batches split these freed blocks, and each micro-batch reserved new segments for them
#: (``benchmarks.memory_phases``: 10 GiB of a graphed ZAYA1-8B run's second step); in their own pool they are
#: reserved once and reused. Kept from call to call; absent where torch has no ``MemPool``.
_POOLS: dict[int, object] = {}


@contextlib.contextmanager
def _own_pool(device: torch.device):
    """Within: this thread's allocations on ``device`` come from the fused head's own pool (GPUs only)."""
    if device.type != "cuda" or not hasattr(torch.cuda, "use_mem_pool"):
        yield
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _POOLS:
        _POOLS[index] = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(_POOLS[index], index):
        yield


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, token_chunk, vocab_chunk, grad_in_forward, weight_grad_into,
                weight_grad_ready, weight_grad_chunks):
        ctx.ignore_index = ignore_index
        ctx.tiles = _tiles(hidden.shape[0], weight.shape[0], token_chunk, vocab_chunk)
        ctx.weight_grad_into, ctx.weight_grad_ready = weight_grad_into, weight_grad_ready
        if grad_in_forward and any(ctx.needs_input_grad[:2]):
            with _own_pool(hidden.device):
                return _LinearCrossEntropy._forward_with_grads(ctx, hidden, weight, labels, ignore_index, token_chunk,
                                                               weight_grad_chunks)
        token_ranges, vocab_ranges = ctx.tiles
        running_max, running_sum, target = _new_statistics(hidden.shape[0], hidden.device)
        for v0, v1 in vocab_ranges:
            for t0, t1 in token_ranges:
                logits = matmul_fp32(hidden[t0:t1], weight[v0:v1].t())
                _accumulate_logsumexp(logits, labels[t0:t1], v0, running_max[t0:t1], running_sum[t0:t1],
                                      target[t0:t1])  # fmt: skip
        loss, lse = _loss(running_max, running_sum, target, labels, ignore_index)
        ctx.save_for_backward(hidden, weight, labels, lse)
        return loss

    @staticmethod
    def _forward_with_grads(ctx, hidden, weight, labels, ignore_index, token_chunk, weight_grad_chunks):
        """Loss, and the gradients for a unit loss gradient per counted token, whole vocabulary per chunk."""
        tokens, vocab = hidden.shape[0], weight.shape[0]
        token_chunk = token_chunk or forward_token_chunk(vocab)
        running_max, running_sum, target = _new_statistics(tokens, hidden.device)
        unit = (labels != ignore_index).float()  # ignored tokens get no gradient, as in the backward
        grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
        chunks = _chunks(tokens, token_chunk)
        for first in range(0, len(chunks), weight_grad_chunks):
            group = chunks[first:first + weight_grad_chunks]
            g0, g1 = group[0][0], group[-1][1]
            grad_logits = torch.empty((g1 - g0, vocab), dtype=hidden.dtype, device=hidden.device)
            for t0, t1 in group:
                rows, chunk_grad = slice(t0, t1), grad_logits[t0 - g0:t1 - g0]
                logits = matmul_fp32(hidden[rows], weight.t())
                _accumulate_logsumexp(logits, labels[rows], 0, running_max[rows], running_sum[rows], target[rows])
                lse = running_max[rows] + torch.log(running_sum[rows])
                _softmax_grad(logits, labels[rows], 0, lse, unit[rows], chunk_grad)
                del logits
                matmul_fp32_into(grad_hidden[rows], chunk_grad, weight)
            # one GEMM for the group's chunks: one read-modify-write of the fp32 [V, D] gradient per group
            matmul_fp32_into(grad_weight, grad_logits.t(), hidden[g0:g1], accumulate=first > 0)
        loss, lse = _loss(running_max, running_sum, target, labels, ignore_index)
        ctx.save_for_backward(hidden, weight, labels, lse, grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, labels, lse, *unit_grads = ctx.saved_tensors  # unit_grads: saved by _forward_with_grads
        grad_loss = torch.where(labels == ctx.ignore_index, 0.0, grad_loss.float())
        into = ctx.weight_grad_into
        if not unit_grads:
            grad_hidden, grad_weight = _recomputed_grads(hidden, weight, labels, lse, grad_loss, ctx.tiles, into)
            grad_hidden = grad_hidden.to(hidden.dtype)
        else:
            unit_grad_hidden, unit_grad_weight = unit_grads
            grad_hidden = (unit_grad_hidden * grad_loss[:, None]).to(hidden.dtype)
            counted = labels != ctx.ignore_index
            scale = torch.where(counted, grad_loss, float("-inf")).amax()
            scale = torch.where(scale.isfinite(), scale, 0.0)  # no counted token: every gradient is 0
            one_factor = torch.where(counted, grad_loss == scale, True).all()
            # Checked on the device, as a host sync would stall an eager step: any other loss gradient makes d weight
            # NaN, which Megatron's check of the gradients stops, rather than silently wrong.
            factor = torch.where(one_factor, scale, float("nan"))
            if into is None:  # scaled in place: no second fp32 [V, D] tensor
                grad_weight = unit_grad_weight.mul_(factor).to(weight.dtype)
            else:
                into.addcmul_(unit_grad_weight, factor)
                grad_weight = None
        if ctx.weight_grad_ready is not None:
            ctx.weight_grad_ready()
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    token_chunk: int | None = None,
    vocab_chunk: int | None = None,
    grad_in_forward: bool = True,
    weight_grad_into: torch.Tensor | None = None,
    weight_grad_ready: Callable[[], None] | None = None,
    weight_grad_chunks: int = WEIGHT_GRAD_CHUNKS,
) -> torch.Tensor:
    """Chunked LM head + cross-entropy; same contract as ``ops.lm_head.linear_cross_entropy``.

    ``token_chunk`` x ``vocab_chunk`` is the logits tile (default: up to 8192 tokens, 2^28 elements).
    ``grad_in_forward`` (when gradients are needed) computes them in the forward over whole-vocabulary token
    chunks (default about 2^29 / V tokens; ``vocab_chunk`` unused), saving the backward's recomputation, and the
    weight's gradient with one GEMM per ``weight_grad_chunks`` of them. The
    weight's gradient then holds for a loss gradient that is one factor for every counted token (any mean or sum of
    the losses, masked tokens given ``ignore_index`` as training does); another gets a NaN one.
    hidden and weight share a dtype (bf16 in training: the GEMMs take bf16 and accumulate and return fp32).
    ``weight_grad_into`` (a tensor of the weight's shape, e.g. its ``main_grad``): the backward adds the weight's
    gradient into it, in place, instead of returning one (pass the weight detached), then calls
    ``weight_grad_ready`` if given.
    """
    if hidden.shape[:-1] != labels.shape or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"need hidden [..., D], weight [V, D], labels [...]; got hidden {list(hidden.shape)}, "
            f"weight {list(weight.shape)}, labels {list(labels.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype for the GEMM")
    if weight_grad_into is not None and weight_grad_into.shape != weight.shape:
        raise ValueError(f"weight_grad_into {list(weight_grad_into.shape)} must have the weight's shape "
                         f"{list(weight.shape)}")
    if weight_grad_chunks < 1:
        raise ValueError(f"weight_grad_chunks must be at least 1, got {weight_grad_chunks}")
    loss = _LinearCrossEntropy.apply(
        flat_rows(hidden), weight.contiguous(), labels.reshape(-1).contiguous(), ignore_index, token_chunk, vocab_chunk,
        grad_in_forward, weight_grad_into, weight_grad_ready, weight_grad_chunks,
    )
    return loss.view(labels.shape)


def runs_on(*tensors: torch.Tensor) -> bool:
    """Whether these kernels run on ``tensors``: all on a GPU, or the kernels are interpreted."""
    return triton_runs(_logsumexp_kernel, *tensors)
