"""ZAYA residual scaling fused with the next RMSNorm, and a plain RMSNorm (Triton, forward and backward).

ZAYA1 merges each sublayer output ``h`` into the fp32 residual stream ``res`` with two learned per-channel
affines and normalises the result for the next sublayer (docs/architecture.md §2):

    new_res = (h + hidden_bias) * hidden_scale + (res + residual_bias) * residual_scale      # in fp32
    normed  = weight * rmsnorm(new_res.to(weight.dtype))

with ``rmsnorm(x) = (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)``, i.e. transformers'
``ZayaRMSNorm`` applied to ``residual.to(weight.dtype)``. (transformers adds the hidden-side affine in the
model dtype; we do the whole merge in fp32.) Unfused, this is ~10 elementwise passes over [T, D]; fused, one
read of ``h`` and ``res`` and one write of ``normed`` and ``new_res``. The backward recomputes ``new_res``
from the saved ``h`` and ``res`` (it needs them anyway for the scale gradients) and reduces the five [D]
vector gradients in per-program partial sums (deterministic, no atomics), summed and cast in one more launch.

Two more entry points serve the rest of a ZAYA1 layer (chosen by the model's ``residual`` kernel op): ``residual_norm``,
the RMSNorm of the fp32 stream as the layer sees it (``weight * rmsnorm(residual.to(weight.dtype))``, the cast
folded into the kernel), and ``residual_merge``, the merge alone (a layer's last merge: the next norm belongs
to the next layer). The torch references, the fallback and the choice live in ``ops/residual_norm.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch
from .utils import (added_to_main_grad, cdiv, column_sums, flat_rows, main_grad_targets, next_power_of_2,
                    persistent_programs, platform, row_block, store_sum, triton_runs)

MAX_HIDDEN = 16384  # one row lives in registers
MAX_TILE = 8192  # elements per tensor of one backward iteration (rows x BLOCK) held in registers

#: Backward launch per platform (``utils.platform()``): rows per iteration, persistent programs per SM/CU,
#: warps (None: from the row width) and the row loop's software-pipeline depth. Tuned on an H200 with
#: ``benchmarks/tune_norm_backward.py``; run it on a new platform and add its row here.
BACKWARD_TUNING = {  # pipeline_bytes: the shared memory the row loop's stages may fill (fewer stages past it)
    "cuda": {"rows": 2, "programs_per_sm": 1, "num_warps": None, "stages": 4,  # H200 at T = 16384, 2026-11-30
             "pipeline_bytes": 200 * 1024},
    "rocm": {"rows": 1, "programs_per_sm": 4, "num_warps": None, "stages": 1,  # not tuned: the first CUDA choice
             "pipeline_bytes": 48 * 1024},
    "cpu": {"rows": 2, "programs_per_sm": 4, "num_warps": None, "stages": 1,  # the interpreter: the row tiles
            "pipeline_bytes": 1 << 30},
}


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _norm_forward_kernel(
    hidden_ptr,  # [T, D] the norm input (plain) or the sublayer output h (residual variant)
    residual_ptr,  # [T, D] residual stream (residual variant only)
    hidden_bias_ptr,
    hidden_scale_ptr,
    residual_bias_ptr,
    residual_scale_ptr,  # [D] each (residual variant only)
    weight_ptr,  # [D]
    out_ptr,  # [T, D]
    new_residual_ptr,  # [T, D] fp32 (residual variant only)
    rstd_ptr,  # [T] fp32
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_NORM: tl.constexpr,  # False: the residual merge alone (writes new_residual only)
    ROUND_INPUT: tl.constexpr,  # plain norm of x.to(weight.dtype): x is the fp32 stream, the cast is folded in
    BLOCK: tl.constexpr,
):
    row = tl.cast(tl.program_id(0), tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offsets = row * n_cols + cols
    if HAS_RESIDUAL:
        h = tl.load(hidden_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        res = tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        hb = tl.load(hidden_bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        hs = tl.load(hidden_scale_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        rb = tl.load(residual_bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        rs = tl.load(residual_scale_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        new_res = (h + hb) * hs + (res + rb) * rs
        tl.store(new_residual_ptr + offsets, new_res, mask=mask)
        norm_dtype = weight_ptr.dtype.element_ty  # the norm sees residual.to(weight.dtype)
        x = new_res.to(norm_dtype).to(tl.float32)
    else:
        norm_dtype = weight_ptr.dtype.element_ty if ROUND_INPUT else hidden_ptr.dtype.element_ty
        x = tl.load(hidden_ptr + offsets, mask=mask, other=0.0).to(norm_dtype).to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        tl.store(rstd_ptr + row, rstd)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x_hat = (x * rstd).to(norm_dtype).to(tl.float32)  # ZayaRMSNorm rounds before applying the weight
        tl.store(out_ptr + offsets, (x_hat * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_backward_kernel(
    grad_out_ptr,  # [T, D]
    grad_new_residual_ptr,  # [T, D] fp32: the new stream's gradient (residual variant), or x's other (ADD_GRAD_X)
    hidden_ptr,
    residual_ptr,
    hidden_bias_ptr,
    hidden_scale_ptr,
    residual_bias_ptr,
    residual_scale_ptr,
    weight_ptr,
    rstd_ptr,
    grad_hidden_ptr,  # [T, D] in hidden's dtype
    grad_residual_ptr,  # [T, D] in residual's dtype (residual variant only)
    partials_ptr,  # [5, programs, D] fp32: weight, hidden_bias, hidden_scale, residual_bias, residual_scale
    n_rows,
    n_cols,
    HAS_RESIDUAL: tl.constexpr,
    HAS_NORM: tl.constexpr,
    ROUND_INPUT: tl.constexpr,
    ADD_GRAD_X: tl.constexpr,  # plain norm: x's gradient is the norm's plus another one, summed here
    ROWS: tl.constexpr,  # rows per loop iteration: more loads in flight per program
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,  # software-pipeline depth of the row loop (the next rows' loads issued early)
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    grad_w = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_RESIDUAL:
        norm_dtype = weight_ptr.dtype.element_ty
        grad_hb = tl.zeros([BLOCK], dtype=tl.float32)
        grad_hs = tl.zeros([BLOCK], dtype=tl.float32)
        grad_rb = tl.zeros([BLOCK], dtype=tl.float32)
        grad_rs = tl.zeros([BLOCK], dtype=tl.float32)
    else:
        norm_dtype = weight_ptr.dtype.element_ty if ROUND_INPUT else hidden_ptr.dtype.element_ty
    for first in tl.range(pid * ROWS, n_rows, programs * ROWS, num_stages=STAGES):
        rows = first + tl.arange(0, ROWS)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        offsets = tl.cast(rows, tl.int64)[:, None] * n_cols + cols[None, :]
        # The [D] vectors are re-read per iteration (they stay in L1/L2) rather than held across the loop: this
        # keeps the residual variant's registers low enough for two programs per SM.
        w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_RESIDUAL:
            hb = tl.load(hidden_bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            hs = tl.load(hidden_scale_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            rb = tl.load(residual_bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            rs = tl.load(residual_scale_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            h_biased = tl.load(hidden_ptr + offsets, mask=mask, other=0.0).to(tl.float32) + hb
            res_biased = tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32) + rb
            x = (h_biased * hs + res_biased * rs).to(norm_dtype).to(tl.float32)
        else:
            x = tl.load(hidden_ptr + offsets, mask=mask, other=0.0).to(norm_dtype).to(tl.float32)
        grad_x = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        if HAS_NORM:
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)[:, None]
            x_hat = x * rstd
            grad_out = tl.load(grad_out_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            grad_w += tl.sum(grad_out * x_hat.to(norm_dtype).to(tl.float32), axis=0)
            grad_x_hat = grad_out * w
            grad_x = rstd * (grad_x_hat - x_hat * (tl.sum(grad_x_hat * x_hat, axis=1) / n_cols)[:, None])
        if HAS_RESIDUAL:
            grad_total = grad_x + tl.load(grad_new_residual_ptr + offsets, mask=mask, other=0.0)
            grad_h = grad_total * hs
            grad_res = grad_total * rs
            tl.store(grad_hidden_ptr + offsets, grad_h.to(grad_hidden_ptr.dtype.element_ty), mask=mask)
            tl.store(grad_residual_ptr + offsets, grad_res.to(grad_residual_ptr.dtype.element_ty), mask=mask)
            grad_hb += tl.sum(grad_h, axis=0)
            grad_hs += tl.sum(grad_total * h_biased, axis=0)
            grad_rb += tl.sum(grad_res, axis=0)
            grad_rs += tl.sum(grad_total * res_biased, axis=0)
        else:
            if ADD_GRAD_X:  # the rounded product plus the other, as autograd sums them: "+ 0.0" keeps out an FMA
                grad_x = (grad_x + 0.0) + tl.load(grad_new_residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            tl.store(grad_hidden_ptr + offsets, grad_x.to(grad_hidden_ptr.dtype.element_ty), mask=mask)
    stride = programs * n_cols
    partial = partials_ptr + pid * n_cols + cols
    tl.store(partial, grad_w, mask=col_mask)
    if HAS_RESIDUAL:
        tl.store(partial + stride, grad_hb, mask=col_mask)
        tl.store(partial + 2 * stride, grad_hs, mask=col_mask)
        tl.store(partial + 3 * stride, grad_rb, mask=col_mask)
        tl.store(partial + 4 * stride, grad_rs, mask=col_mask)


@triton.jit
def _norm_sum_partials_kernel(
    partials_ptr,  # [V, programs, D] fp32 from _norm_backward_kernel
    out0_ptr, out1_ptr, out2_ptr, out3_ptr, out4_ptr,  # [D] each, in its parameter's dtype (V of them used)
    programs,
    n_cols,
    FIRST: tl.constexpr,  # out_v takes partials[v + FIRST]
    ACCUMULATE: tl.constexpr,  # out_v += the sum (a parameter's main_grad), else out_v = the sum
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    """out_v (+)= sum over programs of partials[v + FIRST], cast on store: one launch instead of a sum and a cast
    (and an addition) per vector."""
    vector = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    total = column_sums(partials_ptr + tl.cast(vector + FIRST, tl.int64) * programs * n_cols, programs, n_cols, cols,
                        BLOCK_P)
    if vector == 0:
        store_sum(out0_ptr + cols, total, col_mask, ACCUMULATE)
    elif vector == 1:
        store_sum(out1_ptr + cols, total, col_mask, ACCUMULATE)
    elif vector == 2:
        store_sum(out2_ptr + cols, total, col_mask, ACCUMULATE)
    elif vector == 3:
        store_sum(out3_ptr + cols, total, col_mask, ACCUMULATE)
    else:
        store_sum(out4_ptr + cols, total, col_mask, ACCUMULATE)


# ----------------------------------------------------------------------------------------- autograd


def _launch_forward(hidden, residual, vectors, weight, eps, out_dtype, has_norm=True, round_input=False):
    """``vectors`` = the four residual affines, or None for the plain norm (the kernel then ignores them).

    Without ``has_norm`` (the merge alone) ``weight`` only fills the unused pointer slots."""
    rows, n_cols = hidden.shape
    block, num_warps = row_block(n_cols, MAX_HIDDEN, "rms_norm")
    out = torch.empty((rows, n_cols), dtype=out_dtype, device=hidden.device) if has_norm else None
    rstd = torch.empty(rows, dtype=torch.float32, device=hidden.device) if has_norm else None
    new_residual = torch.empty((rows, n_cols), dtype=torch.float32, device=hidden.device) if vectors else None
    launch(_norm_forward_kernel, (rows,),
        hidden, residual, *(vectors or (weight,) * 4), weight, out, new_residual, rstd, n_cols, eps,
        HAS_RESIDUAL=bool(vectors), HAS_NORM=has_norm, ROUND_INPUT=round_input, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
    return out, new_residual, rstd


def _launch_backward(grad_out, grad_new_residual, hidden, residual, vectors, weight, rstd, round_input=False):
    """Returns (grad_hidden, grad_residual, grads): the gradients of the weight (with a norm, ``grad_out`` given)
    and of the vectors (with a merge), in their dtypes; placeholders where they were added into ``main_grad``."""
    rows, n_cols = hidden.shape
    block, num_warps = row_block(n_cols, MAX_HIDDEN, "rms_norm")
    tuning = BACKWARD_TUNING[platform(hidden.device)]
    tile_rows = tuning["rows"] if block * tuning["rows"] <= MAX_TILE else 1
    programs = persistent_programs(hidden.device, cdiv(rows, tile_rows), tuning["programs_per_sm"])
    # Each pipeline stage buffers one iteration's row tiles in shared memory: fewer stages for wide rows.
    loaded = [t for t in (grad_out, grad_new_residual, hidden, residual) if t is not None]
    stage_bytes = tile_rows * block * sum(t.element_size() for t in loaded)
    stages = max(1, min(tuning["stages"], tuning["pipeline_bytes"] // stage_bytes))
    grad_hidden = torch.empty_like(hidden)
    grad_residual = torch.empty_like(residual) if vectors else None
    partials = torch.empty((5 if vectors else 1, programs, n_cols), dtype=torch.float32, device=hidden.device)
    launch(_norm_backward_kernel, (programs,),
        grad_out, grad_new_residual, hidden, residual, *(vectors or (weight,) * 4), weight, rstd,
        grad_hidden, grad_residual, partials, rows, n_cols,
        HAS_RESIDUAL=bool(vectors), HAS_NORM=grad_out is not None, ROUND_INPUT=round_input,
        ADD_GRAD_X=not vectors and grad_new_residual is not None, ROWS=tile_rows,
        BLOCK=block, STAGES=stages, num_warps=tuning["num_warps"] or num_warps,
    )  # fmt: skip
    params = ([weight] if grad_out is not None else []) + list(vectors or ())
    targets = main_grad_targets(params)
    outs = targets or [torch.empty(n_cols, dtype=p.dtype, device=hidden.device) for p in params]
    block_c = min(128, next_power_of_2(n_cols))
    unused = outs[:1] * (5 - len(outs))  # the kernel's spare output pointers, never stored to
    launch(_norm_sum_partials_kernel, (cdiv(n_cols, block_c), len(outs)),
        partials, *outs, *unused, programs, n_cols, FIRST=0 if grad_out is not None else 1,
        ACCUMULATE=targets is not None, BLOCK_P=32, BLOCK_C=block_c,
    )  # fmt: skip
    return grad_hidden, grad_residual, outs if targets is None else added_to_main_grad(params)


class RMSNorm(torch.autograd.Function):
    """``weight * rmsnorm(x)``; with ``round_input``, of ``x.to(weight.dtype)`` (the gradient passes the cast)."""

    @staticmethod
    def forward(ctx, x, weight, eps, round_input):
        x2d = flat_rows(x)
        out_dtype = weight.dtype if round_input else torch.promote_types(x.dtype, weight.dtype)
        out, _, rstd = _launch_forward(x2d, None, None, weight, eps, out_dtype, round_input=round_input)
        ctx.save_for_backward(x2d, weight, rstd)
        ctx.round_input = round_input
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        return RMSNorm.backward_adding(ctx, grad_out, None)

    @staticmethod
    def backward_adding(ctx, grad_out, other_grad_x: torch.Tensor | None):
        """:meth:`backward`; given ``other_grad_x`` (another gradient of x, in x's dtype and shape), x's gradient is
        the norm's plus it, summed in the launch that makes the norm's (what autograd's sum of the two gives)."""
        x2d, weight, rstd = ctx.saved_tensors
        if other_grad_x is not None and (other_grad_x.shape != grad_out.shape or other_grad_x.dtype != x2d.dtype):
            raise ValueError(f"x's other gradient must be {tuple(grad_out.shape)} {x2d.dtype}")
        other = None if other_grad_x is None else flat_rows(other_grad_x)
        grad_x, _, grads = _launch_backward(flat_rows(grad_out), other, x2d, None, None, weight, rstd,
                                            round_input=ctx.round_input)
        return grad_x.view(grad_out.shape), grads[0], None, None


class ResidualRMSNorm(torch.autograd.Function):
    """:func:`residual_rms_norm`: the merge and the norm in one pass each way (the merge recomputed backward)."""

    @staticmethod
    def forward(ctx, hidden, residual, hidden_bias, hidden_scale, residual_bias, residual_scale, weight, eps):
        vectors = (hidden_bias, hidden_scale, residual_bias, residual_scale)
        h2d, res2d = flat_rows(hidden), flat_rows(residual)
        normed, new_residual, rstd = _launch_forward(h2d, res2d, vectors, weight, eps, weight.dtype)
        ctx.save_for_backward(h2d, res2d, *vectors, weight, rstd)
        return normed.view(hidden.shape), new_residual.view(hidden.shape)

    @staticmethod
    def backward(ctx, grad_normed, grad_new_residual):
        h2d, res2d, *vectors, weight, rstd = ctx.saved_tensors
        grad_h, grad_res, grads = _launch_backward(
            flat_rows(grad_normed), flat_rows(grad_new_residual.float()), h2d, res2d, vectors, weight, rstd
        )
        grad_w, *grad_vectors = grads
        return grad_h.view(grad_normed.shape), grad_res.view(grad_normed.shape), *grad_vectors, grad_w, None


class _ResidualMerge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, residual, hidden_bias, hidden_scale, residual_bias, residual_scale):
        vectors = (hidden_bias, hidden_scale, residual_bias, residual_scale)
        h2d, res2d = flat_rows(hidden), flat_rows(residual)
        _, new_residual, _ = _launch_forward(h2d, res2d, vectors, hidden_scale, 0.0, None, has_norm=False)
        ctx.save_for_backward(h2d, res2d, *vectors)
        return new_residual.view(hidden.shape)

    @staticmethod
    def backward(ctx, grad_new_residual):
        h2d, res2d, *vectors = ctx.saved_tensors
        grad_h, grad_res, grads = _launch_backward(
            None, flat_rows(grad_new_residual.float()), h2d, res2d, vectors, vectors[1], None
        )
        shape = grad_new_residual.shape
        return grad_h.view(shape), grad_res.view(shape), *grads


# ----------------------------------------------------------------------------------------- public API


def runs_on(*tensors: torch.Tensor) -> bool:
    """Whether these kernels run on ``tensors``: all on a GPU, or the kernels are interpreted."""
    return triton_runs(_norm_forward_kernel, *tensors)


def _check_vector(name: str, v: torch.Tensor, n: int) -> None:
    if v.shape != (n,):
        raise ValueError(f"{name} must have shape [{n}] (the hidden size), got {list(v.shape)}")


def _check_residual_args(hidden, residual, vectors) -> None:
    """One shape for hidden and residual; ``vectors`` (the four affines, then the norm weight if any) [D]."""
    if hidden.shape != residual.shape:
        raise ValueError(f"hidden {list(hidden.shape)} and residual {list(residual.shape)} must have one shape")
    for name, v in zip(("hidden_bias", "hidden_scale", "residual_bias", "residual_scale", "weight"), vectors):
        _check_vector(name, v, hidden.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rmsnorm(x)``: x [..., D], weight [D] -> [..., D] in promote(x, weight) dtype."""
    _check_vector("weight", weight, x.shape[-1])
    return RMSNorm.apply(x, weight, eps, False)


def residual_norm(residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rmsnorm(residual.to(weight.dtype))`` in weight's dtype; same contract as
    ``ops.residual_norm.residual_norm``, without materialising the cast."""
    _check_vector("weight", weight, residual.shape[-1])
    return RMSNorm.apply(residual, weight, eps, True)


def residual_merge(hidden, residual, hidden_bias, hidden_scale, residual_bias, residual_scale) -> torch.Tensor:
    """Fused ZAYA residual merge (fp32); same contract as ``ops.residual_norm.residual_merge``."""
    vectors = (hidden_bias, hidden_scale, residual_bias, residual_scale)
    _check_residual_args(hidden, residual, vectors)
    return _ResidualMerge.apply(hidden, residual, *vectors)


def residual_rms_norm(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    hidden_bias: torch.Tensor,
    hidden_scale: torch.Tensor,
    residual_bias: torch.Tensor,
    residual_scale: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ZAYA residual merge + RMSNorm; same contract as ``ops.residual_norm.residual_rms_norm``:
    (normed in weight's dtype, new fp32 residual)."""
    vectors = (hidden_bias, hidden_scale, residual_bias, residual_scale, weight)
    _check_residual_args(hidden, residual, vectors)
    return ResidualRMSNorm.apply(hidden, residual, *vectors, eps)
