"""CCA (compressed convolutional attention) q/k projection (docs/architecture.md §3).

From the pre-conv projections q0 [S, B, nq*d] and k0 [S, B, nkv*d] (g = nq / nkv query heads per KV head):

1. causal convolutions over time, per channel group, exactly as transformers' ``ZayaCCAProjection``: the
   sequence is left-padded once by (t0 - 1) + (t1 - 1) zeros, then a depthwise conv (t0 taps, bias) and a
   per-head grouped conv (each output channel of a head mixes the head's d channels over t1 taps, bias).
   Because the padding comes before both convs, the grouped conv sees the depthwise bias (not zero) at
   the padded positions;
2. mean skip terms: q_res[i] = (q0[i] + k0[i // g]) / 2, k_res[j] = mean of q_res over the g heads of group j;
   q = conv(q0) + q_res, k = conv(k0) + k_res;
3. L2 norm of each head to sqrt(d) (norm clamped at fp32's eps), then k *= temp[j];
4. rotary embedding (NeoX rotate-half) on dims [0, rot) of every head; dims [rot, d) carry no position.

The torch reference is the model's, ``ops/cca.py``'s ``cca_qk`` (``causal_convs`` for the convolutions), which
also holds the fallback and the choice. Two families of Triton kernels:

* the convolutions (``causal_qk_convs_fused``): one forward kernel per q or k (both convs; a program holds a
  block of token rows of one head, the depthwise taps as fp32 multiply-adds, the grouped conv as one
  tensor-core dot per tap); backward, the grouped and depthwise convs' input-gradient kernels (the second also
  sums the bias and depthwise-tap gradients per program), a grouped-weight-gradient kernel that recomputes the
  depthwise output, and one that finishes every parameter's gradient from those partial sums (straight into
  Megatron's ``main_grad`` where there is one). No padded copy, window stack or layout transpose is
  materialised; the history of context-parallel chunks is read in place;
* the epilogue (steps 2-4), forward and backward: one read of conv(q0), conv(k0), q0, k0 and one write of q, k
  per token, with every head of a token in one program (the k skip term needs all g query heads of its group).
  In fp32 internally.

The value time-delay (``ops/cca.py``'s ``delay_channels``) is a GEMM plus a one-token shift of some channels: one
kernel each way (``DelayChannels``, the rows before context-parallel chunks read in place), which the
``cca_sublayer`` op runs; the layer op by op shifts in torch.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from .launch import launch
from .utils import (added_to_main_grad, cdiv, column_sums, main_grad_targets, next_power_of_2, persistent_programs,
                    platform, store_sum, triton_runs)


def _split_history(history, q_width: int):
    return (None, None) if history is None else (history[..., :q_width], history[..., q_width:])


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _pre_norm_segment(q_conv_ptr, k_conv_ptr, q0_ptr, k0_ptr, q_offsets, k_offsets, q_mask, k_mask,
                      GROUP: tl.constexpr):  # fmt: skip
    """Step 2 on one column segment: q [KV, G, W] and k [KV, 1, W] before the norm, fp32."""
    q0 = tl.load(q0_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32)
    k0 = tl.load(k0_ptr + k_offsets, mask=k_mask, other=0.0).to(tl.float32)
    q_res = tl.where(q_mask, (q0 + k0) * 0.5, 0.0)
    k_res = tl.sum(q_res, axis=1, keep_dims=True) / GROUP
    q = tl.load(q_conv_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32) + q_res
    k = tl.load(k_conv_ptr + k_offsets, mask=k_mask, other=0.0).to(tl.float32) + k_res
    return q, k


@triton.jit
def _pre_norm(q_conv_ptr, k_conv_ptr, q0_ptr, k0_ptr, q_base, k_base, q_rope, k_rope, q_pass, k_pass,
              HALF: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
    """Step 2 on a token's three column segments (rotated halves a, b and the pass-through p) and the q/k
    norms before step 3; the forward and the backward (which recomputes it) share it."""
    segment = (q_conv_ptr, k_conv_ptr, q0_ptr, k0_ptr)
    q_a, k_a = _pre_norm_segment(*segment, q_base, k_base, q_rope, k_rope, GROUP)
    q_b, k_b = _pre_norm_segment(*segment, q_base + HALF, k_base + HALF, q_rope, k_rope, GROUP)
    q_p, k_p = _pre_norm_segment(*segment, q_base + 2 * HALF, k_base + 2 * HALF, q_pass, k_pass, GROUP)
    q_norm = tl.sqrt(tl.sum(q_a * q_a, axis=2) + tl.sum(q_b * q_b, axis=2) + tl.sum(q_p * q_p, axis=2))
    k_norm = tl.sqrt(tl.sum(k_a * k_a, axis=2) + tl.sum(k_b * k_b, axis=2) + tl.sum(k_p * k_p, axis=2))
    return q_a, k_a, q_b, k_b, q_p, k_p, q_norm, k_norm


@triton.jit
def _layout(token, batch, cos_stride_s, cos_stride_b, N_KV: tl.constexpr, GROUP: tl.constexpr,
            HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_G: tl.constexpr,
            BLOCK_W: tl.constexpr):  # fmt: skip
    """Offsets of the three column segments [0, HALF), [HALF, 2 HALF), [2 HALF, d) of every head of a token."""
    kv = tl.arange(0, BLOCK_KV)[:, None, None]
    grp = tl.arange(0, BLOCK_G)[None, :, None]
    col = tl.arange(0, BLOCK_W)[None, None, :]
    q_base = token * (N_KV * GROUP * HEAD_DIM) + (kv * GROUP + grp) * HEAD_DIM + col  # [KV, G, W]
    k_base = token * (N_KV * HEAD_DIM) + kv * HEAD_DIM + col  # [KV, 1, W]
    rope_mask = col < HALF
    pass_mask = col < HEAD_DIM - 2 * HALF
    q_heads = (kv < N_KV) & (grp < GROUP)
    rope_base = (token // batch) * cos_stride_s + (token % batch) * cos_stride_b + col  # [1, 1, W]
    return q_base, k_base, q_heads & rope_mask, (kv < N_KV) & rope_mask, q_heads & pass_mask, \
        (kv < N_KV) & pass_mask, rope_base, rope_mask


@triton.jit
def _rope_angles(cos_ptr, sin_ptr, rope_base, rope_mask, HALF: tl.constexpr):
    """cos and sin of both rotated halves of a token's heads, in fp32."""
    cos_a = tl.load(cos_ptr + rope_base, mask=rope_mask, other=0.0).to(tl.float32)
    cos_b = tl.load(cos_ptr + rope_base + HALF, mask=rope_mask, other=0.0).to(tl.float32)
    sin_a = tl.load(sin_ptr + rope_base, mask=rope_mask, other=0.0).to(tl.float32)
    sin_b = tl.load(sin_ptr + rope_base + HALF, mask=rope_mask, other=0.0).to(tl.float32)
    return cos_a, cos_b, sin_a, sin_b


@triton.jit
def _qk_epilogue_forward_kernel(
    q_conv_ptr, k_conv_ptr, q0_ptr, k0_ptr,  # [T, nq*d], [T, nkv*d], [T, nq*d], [T, nkv*d]
    temp_ptr,  # [nkv]
    cos_ptr, sin_ptr,  # [S, B or 1, rot] via strides
    q_out_ptr, k_out_ptr,  # [T, nq*d], [T, nkv*d]
    batch, cos_stride_s, cos_stride_b, eps,
    N_KV: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_KV: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    token = tl.cast(tl.program_id(0), tl.int64)
    q_base, k_base, q_rope, k_rope, q_pass, k_pass, rope_base, rope_mask = _layout(
        token, batch, cos_stride_s, cos_stride_b, N_KV, GROUP, HEAD_DIM, HALF, BLOCK_KV, BLOCK_G, BLOCK_W)
    q_a, k_a, q_b, k_b, q_p, k_p, q_norm, k_norm = _pre_norm(
        q_conv_ptr, k_conv_ptr, q0_ptr, k0_ptr, q_base, k_base, q_rope, k_rope, q_pass, k_pass, HALF, GROUP)
    root_d = tl.sqrt(float(HEAD_DIM))
    temp = tl.load(temp_ptr + tl.arange(0, BLOCK_KV), mask=tl.arange(0, BLOCK_KV) < N_KV, other=0.0)
    q_scale = (root_d / tl.maximum(q_norm, eps))[:, :, None]
    k_scale = (root_d / tl.maximum(k_norm, eps) * temp.to(tl.float32)[:, None])[:, :, None]

    cos_a, cos_b, sin_a, sin_b = _rope_angles(cos_ptr, sin_ptr, rope_base, rope_mask, HALF)
    q_type = q_out_ptr.dtype.element_ty
    k_type = k_out_ptr.dtype.element_ty
    tl.store(q_out_ptr + q_base, ((q_a * cos_a - q_b * sin_a) * q_scale).to(q_type), mask=q_rope)
    tl.store(q_out_ptr + q_base + HALF, ((q_b * cos_b + q_a * sin_b) * q_scale).to(q_type), mask=q_rope)
    tl.store(q_out_ptr + q_base + 2 * HALF, (q_p * q_scale).to(q_type), mask=q_pass)
    tl.store(k_out_ptr + k_base, ((k_a * cos_a - k_b * sin_a) * k_scale).to(k_type), mask=k_rope)
    tl.store(k_out_ptr + k_base + HALF, ((k_b * cos_b + k_a * sin_b) * k_scale).to(k_type), mask=k_rope)
    tl.store(k_out_ptr + k_base + 2 * HALF, (k_p * k_scale).to(k_type), mask=k_pass)


@triton.jit
def _norm_backward(x_a, x_b, x_p, g_a, g_b, g_p, norm, scale, eps):
    """Gradient through y = x * scale, scale = sqrt(d) / max(|x|, eps), per head (last axis = columns)."""
    dot = tl.sum(x_a * g_a, axis=2) + tl.sum(x_b * g_b, axis=2) + tl.sum(x_p * g_p, axis=2)
    coef = tl.where(norm > eps, dot / (norm * norm), 0.0)[:, :, None] * scale
    return scale * g_a - x_a * coef, scale * g_b - x_b * coef, scale * g_p - x_p * coef


@triton.jit
def _store_input_grads(grad_q_conv_ptr, grad_k_conv_ptr, grad_q0_ptr, grad_k0_ptr, dq, dk, q_offsets, k_offsets,
                       q_mask, k_mask, GROUP: tl.constexpr):  # fmt: skip
    """Step 2 backward on one segment: q = conv_q + q_res, k = conv_k + mean_g(q_res), q_res = (q0 + k0) / 2."""
    tl.store(grad_q_conv_ptr + q_offsets, dq.to(grad_q_conv_ptr.dtype.element_ty), mask=q_mask)
    tl.store(grad_k_conv_ptr + k_offsets, dk.to(grad_k_conv_ptr.dtype.element_ty), mask=k_mask)
    grad_q_res = tl.where(q_mask, dq + dk / GROUP, 0.0)
    tl.store(grad_q0_ptr + q_offsets, (grad_q_res * 0.5).to(grad_q0_ptr.dtype.element_ty), mask=q_mask)
    grad_k0 = tl.sum(grad_q_res, axis=1, keep_dims=True) * 0.5
    tl.store(grad_k0_ptr + k_offsets, grad_k0.to(grad_k0_ptr.dtype.element_ty), mask=k_mask)


@triton.jit
def _strided(offsets, token, batch, width, stride_s, stride_b, stride_c):
    """``offsets`` of a token's columns in a contiguous [T, width] as offsets into [S, B, width] of these strides."""
    return (token // batch) * stride_s + (token % batch) * stride_b + (offsets - token * width) * stride_c


@triton.jit
def _qk_epilogue_backward_kernel(
    grad_q_ptr, grad_k_ptr,  # [S, B, nq*d], [S, B, nkv*d] via strides
    q_conv_ptr, k_conv_ptr, q0_ptr, k0_ptr, temp_ptr, cos_ptr, sin_ptr,
    grad_q_conv_ptr, grad_k_conv_ptr, grad_q0_ptr, grad_k0_ptr,  # like the inputs
    grad_temp_ptr,  # [T, nkv] fp32 per-token partial sums
    batch, cos_stride_s, cos_stride_b, eps,
    grad_q_stride_s, grad_q_stride_b, grad_q_stride_c, grad_k_stride_s, grad_k_stride_b, grad_k_stride_c,
    N_KV: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_KV: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    token = tl.cast(tl.program_id(0), tl.int64)
    q_base, k_base, q_rope, k_rope, q_pass, k_pass, rope_base, rope_mask = _layout(
        token, batch, cos_stride_s, cos_stride_b, N_KV, GROUP, HEAD_DIM, HALF, BLOCK_KV, BLOCK_G, BLOCK_W)
    q_a, k_a, q_b, k_b, q_p, k_p, q_norm, k_norm = _pre_norm(
        q_conv_ptr, k_conv_ptr, q0_ptr, k0_ptr, q_base, k_base, q_rope, k_rope, q_pass, k_pass, HALF, GROUP)
    root_d = tl.sqrt(float(HEAD_DIM))
    q_scale = (root_d / tl.maximum(q_norm, eps))[:, :, None]
    k_head_scale = root_d / tl.maximum(k_norm, eps)  # [KV, 1]
    k_scale = k_head_scale[:, :, None]
    kv = tl.arange(0, BLOCK_KV)
    temp = tl.load(temp_ptr + kv, mask=kv < N_KV, other=0.0).to(tl.float32)[:, None, None]

    cos_a, cos_b, sin_a, sin_b = _rope_angles(cos_ptr, sin_ptr, rope_base, rope_mask, HALF)
    # Rotation transposed: gradients w.r.t. the normalised (pre-RoPE) heads.
    grad_q = _strided(q_base, token, batch, N_KV * GROUP * HEAD_DIM, grad_q_stride_s, grad_q_stride_b,
                      grad_q_stride_c)  # fmt: skip
    do_a = tl.load(grad_q_ptr + grad_q, mask=q_rope, other=0.0).to(tl.float32)
    do_b = tl.load(grad_q_ptr + grad_q + HALF * grad_q_stride_c, mask=q_rope, other=0.0).to(tl.float32)
    gq_a, gq_b = do_a * cos_a + do_b * sin_b, do_b * cos_b - do_a * sin_a
    gq_p = tl.load(grad_q_ptr + grad_q + 2 * HALF * grad_q_stride_c, mask=q_pass, other=0.0).to(tl.float32)
    grad_k = _strided(k_base, token, batch, N_KV * HEAD_DIM, grad_k_stride_s, grad_k_stride_b, grad_k_stride_c)
    do_a = tl.load(grad_k_ptr + grad_k, mask=k_rope, other=0.0).to(tl.float32)
    do_b = tl.load(grad_k_ptr + grad_k + HALF * grad_k_stride_c, mask=k_rope, other=0.0).to(tl.float32)
    gk_a, gk_b = do_a * cos_a + do_b * sin_b, do_b * cos_b - do_a * sin_a
    gk_p = tl.load(grad_k_ptr + grad_k + 2 * HALF * grad_k_stride_c, mask=k_pass, other=0.0).to(tl.float32)

    # k_out = temp * k * k_scale: temperature gradient, then through the norm.
    grad_temp = tl.sum(tl.sum(gk_a * k_a + gk_b * k_b + gk_p * k_p, axis=2) * k_head_scale, axis=1)
    tl.store(grad_temp_ptr + token * N_KV + kv, grad_temp, mask=kv < N_KV)
    dq_a, dq_b, dq_p = _norm_backward(q_a, q_b, q_p, gq_a, gq_b, gq_p, q_norm, q_scale, eps)
    gk_a, gk_b, gk_p = gk_a * temp, gk_b * temp, gk_p * temp
    dk_a, dk_b, dk_p = _norm_backward(k_a, k_b, k_p, gk_a, gk_b, gk_p, k_norm, k_scale, eps)

    grads = (grad_q_conv_ptr, grad_k_conv_ptr, grad_q0_ptr, grad_k0_ptr)
    _store_input_grads(*grads, dq_a, dk_a, q_base, k_base, q_rope, k_rope, GROUP)
    _store_input_grads(*grads, dq_b, dk_b, q_base + HALF, k_base + HALF, q_rope, k_rope, GROUP)
    _store_input_grads(*grads, dq_p, dk_p, q_base + 2 * HALF, k_base + 2 * HALF, q_pass, k_pass, GROUP)


@triton.jit
def _sum_rows_kernel(partials_ptr, out_ptr, rows, n_cols, ACCUMULATE: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_C: tl.constexpr):  # fmt: skip
    """out (+)= the sum over rows of fp32 partials [rows, n_cols]: the key temperature's gradient."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    store_sum(out_ptr + cols, column_sums(partials_ptr, rows, n_cols, cols, BLOCK_R), cols < n_cols, ACCUMULATE)


# ------------------------------------------------------------------------------ convolution kernels
# A program holds BLOCK_ROWS token rows of one head's d channels. Rows are position-major, batch-minor
# (row = position * B + b, the [S, B, C] layout). Positions count within a chunk: under context parallelism
# x is n chunks of L positions, each preceded by its own history; otherwise n = 1, L = S, and positions before
# 0 read zeros. Both convolutions' products accumulate in fp32; the depthwise output is rounded to x's dtype
# before the grouped conv's tensor-core dot (``ops.cca.causal_convs`` run in x's dtype does the same). Packed
# documents (HAS_DOCS): ``offsets`` [n·L, B] gives each position's earlier tokens in its document, and a term
# reaching further back is left out (see ``ops.cca.causal_convs``).


@triton.jit
def _earlier_tokens(offsets_ptr, chunk, pos, b, valid, length, batch):
    """Earlier tokens of its document at each row's position. A position before the chunk (pos < 0) continues
    the document of the chunk's first token, so it has that token's count + pos (negative: another document)."""
    first = tl.load(offsets_ptr + (chunk * length + tl.maximum(pos, 0)) * batch + b, mask=valid & (pos < length),
                    other=0)  # fmt: skip
    return first + tl.minimum(pos, 0)


@triton.jit
def _rows(x_ptr, history_ptr, chunk, pos, b, cols, valid, length, batch, channels,
          PAD: tl.constexpr, HAS_HISTORY: tl.constexpr):  # fmt: skip
    """x at (chunk, position, b) of each row, in the head's columns [R, D], in x's dtype. Positions in
    [-PAD, 0) read the chunk's history (zeros without one); other positions and invalid rows read zeros."""
    inside = valid & (pos >= 0) & (pos < length)
    offsets = ((chunk * length + pos) * batch + b) * channels
    x = tl.load(x_ptr + offsets[:, None] + cols[None, :], mask=inside[:, None], other=0.0)
    if HAS_HISTORY:
        before = valid & (pos < 0) & (pos >= -PAD)
        offsets = ((chunk * PAD + PAD + pos) * batch + b) * channels
        earlier = tl.load(history_ptr + offsets[:, None] + cols[None, :], mask=before[:, None], other=0.0)
        x = tl.where(before[:, None], earlier, x)
    return x


@triton.jit
def _depthwise(x_ptr, history_ptr, w1_ptr, b1_ptr, chunk, pos, visible, b, cols, valid, length, batch, channels,
               T0: tl.constexpr, PAD: tl.constexpr, HAS_HISTORY: tl.constexpr, HAS_DOCS: tl.constexpr,
               BLOCK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    """The depthwise conv at positions ``pos`` (taps on pos - T0 + 1 .. pos, bias included), in x's dtype; with
    HAS_DOCS only the taps at most ``visible`` tokens back."""
    y = tl.zeros([BLOCK_ROWS, HEAD_DIM], tl.float32) + tl.load(b1_ptr + cols).to(tl.float32)[None, :]
    for j in tl.static_range(T0):
        w = tl.load(w1_ptr + cols * T0 + j).to(tl.float32)
        x = _rows(x_ptr, history_ptr, chunk, pos - (T0 - 1) + j, b, cols, valid, length, batch, channels, PAD,
                  HAS_HISTORY)  # fmt: skip
        if HAS_DOCS:
            x = tl.where((visible >= T0 - 1 - j)[:, None], x, 0.0)
        y += x.to(tl.float32) * w[None, :]
    return y.to(x_ptr.dtype.element_ty)


@triton.jit
def _grouped_input(x_ptr, history_ptr, w1_ptr, b1_ptr, chunk, pos, earlier, lag, b, cols, valid, length, batch,
                   channels, T0: tl.constexpr, PAD: tl.constexpr, HAS_HISTORY: tl.constexpr, HAS_DOCS: tl.constexpr,
                   BLOCK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    """What the grouped conv's tap ``lag`` reads for outputs at ``pos``: the depthwise conv at pos - lag. With
    HAS_DOCS (``earlier``: the outputs' earlier tokens in their documents), its taps within the document, and
    the depthwise bias alone where pos - lag lies before the document (a zero-padded position)."""
    y = _depthwise(x_ptr, history_ptr, w1_ptr, b1_ptr, chunk, pos - lag, earlier - lag, b, cols, valid, length,
                   batch, channels, T0, PAD, HAS_HISTORY, HAS_DOCS, BLOCK_ROWS, HEAD_DIM)  # fmt: skip
    if HAS_DOCS:
        bias = tl.load(b1_ptr + cols).to(tl.float32).to(y.dtype)
        y = tl.where((earlier >= lag)[:, None], y, bias[None, :])
    return y


@triton.jit
def _conv_forward_kernel(
    x_ptr, history_ptr,  # [n·L, B, C]; [n, PAD, B, C] when HAS_HISTORY
    offsets_ptr,  # [n·L, B] int32 when HAS_DOCS
    w1_ptr, b1_ptr, w2_ptr, b2_ptr,  # [C, T0], [C], [C, D, T1], [C]
    out_ptr,  # [n·L, B, C]
    length, batch, channels,
    T0: tl.constexpr, T1: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    HAS_HISTORY: tl.constexpr, HAS_DOCS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """out(p) = b2 + sum over taps of y(p - T1 + 1 + tap) @ w2[:, :, tap]^T for one head; y = the depthwise conv."""
    PAD: tl.constexpr = (T0 - 1) + (T1 - 1)
    block, head = tl.program_id(0), tl.program_id(1)
    blocks_per_chunk = tl.cdiv(length * batch, BLOCK_ROWS)
    chunk = tl.cast(block // blocks_per_chunk, tl.int64)
    row = (block % blocks_per_chunk) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    valid = row < length * batch
    pos, b = tl.cast(row // batch, tl.int64), row % batch
    d = tl.arange(0, HEAD_DIM)
    cols = head * HEAD_DIM + d
    earlier = _earlier_tokens(offsets_ptr, chunk, pos, b, valid, length, batch) if HAS_DOCS else pos
    acc = tl.zeros([BLOCK_ROWS, HEAD_DIM], tl.float32)
    for tap in tl.static_range(T1):
        y = _grouped_input(x_ptr, history_ptr, w1_ptr, b1_ptr, chunk, pos, earlier, T1 - 1 - tap, b, cols, valid,
                           length, batch, channels, T0, PAD, HAS_HISTORY, HAS_DOCS, BLOCK_ROWS, HEAD_DIM)  # fmt: skip
        # [in, out]: the contraction dim has the small stride (T1), which the dot wants (a transposed tile is 4x slower)
        w = tl.load(w2_ptr + cols[None, :] * (HEAD_DIM * T1) + d[:, None] * T1 + tap).to(y.dtype)
        acc = tl.dot(y, w, acc, input_precision=DOT_PRECISION)
    bias = tl.load(b2_ptr + cols).to(out_ptr.dtype.element_ty).to(tl.float32)
    offsets = ((chunk * length + pos) * batch + b) * channels
    tl.store(out_ptr + offsets[:, None] + cols[None, :], (acc + bias[None, :]).to(out_ptr.dtype.element_ty),
             mask=valid[:, None])  # fmt: skip


@triton.jit
def _conv_grouped_grad_kernel(
    grad_ptr, w2_ptr,  # grad [n·L, B, C] of the output; w2 as [H, T1, D_in, D_out] (D_out, contracted, unit stride)
    offsets_ptr,  # [n·L, B] int32 when HAS_DOCS
    grad_y_ptr,  # [n, L + T1 - 1, B, C]: the depthwise output's gradient at positions -(T1 - 1) .. L - 1
    length, batch, channels,
    T1: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, HAS_DOCS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """dy(u) = sum over taps of g(u + T1 - 1 - tap) @ w2[:, :, tap] for one head: the grouped conv's input grad
    (with HAS_DOCS, only from outputs in u's document)."""
    block, head = tl.program_id(0), tl.program_id(1)
    extent = length + T1 - 1
    blocks_per_chunk = tl.cdiv(extent * batch, BLOCK_ROWS)
    chunk = tl.cast(block // blocks_per_chunk, tl.int64)
    row = (block % blocks_per_chunk) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    valid = row < extent * batch
    pos, b = tl.cast(row // batch, tl.int64) - (T1 - 1), row % batch
    d = tl.arange(0, HEAD_DIM)
    cols = head * HEAD_DIM + d
    grad_y = tl.zeros([BLOCK_ROWS, HEAD_DIM], tl.float32)
    for tap in tl.static_range(T1):
        g = _rows(grad_ptr, grad_ptr, chunk, pos + (T1 - 1 - tap), b, cols, valid, length, batch, channels, 0, False)
        if HAS_DOCS:
            earlier = _earlier_tokens(offsets_ptr, chunk, pos + (T1 - 1 - tap), b, valid, length, batch)
            g = tl.where((earlier >= T1 - 1 - tap)[:, None], g, 0.0)
        w = tl.load(w2_ptr + ((head * T1 + tap) * HEAD_DIM + d[None, :]) * HEAD_DIM + d[:, None])  # [out, in]
        w = w.to(g.dtype)
        grad_y = tl.dot(g, w, grad_y, input_precision=DOT_PRECISION)
    offsets = ((chunk * extent + pos + (T1 - 1)) * batch + b) * channels
    tl.store(grad_y_ptr + offsets[:, None] + cols[None, :], grad_y.to(grad_y_ptr.dtype.element_ty),
             mask=valid[:, None])  # fmt: skip


@triton.jit
def _conv_depthwise_grad_kernel(
    grad_ptr, grad_y_ptr, x_ptr, history_ptr, w1_ptr,  # grad, x [n·L, B, C]; grad_y from the kernel above
    offsets_ptr,  # [n·L, B] int32 when HAS_DOCS
    grad_x_ptr, grad_history_ptr,  # like x and history
    partial_ptr,  # [programs along axis 0, 1 + T0, C] fp32: per-program sums for d b2, d w1[:, j]
    length, batch, channels,
    T0: tl.constexpr, T1: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    HAS_HISTORY: tl.constexpr, HAS_DOCS: tl.constexpr, ADD_INTO: tl.constexpr,
):  # fmt: skip
    """Rows are positions -PAD .. L - 1 of each chunk: dx(p) = sum_j w1[j] dy(p + T0 - 1 - j) (with HAS_DOCS,
    the terms whose dy position has p in its document); positions < 0 are the history's gradient. The output
    bias and depthwise-tap gradients are sums over the same rows, left per program for one reduction. With
    ADD_INTO, grad_x holds another gradient of x, to which dx is added as torch adds two tensors of its dtype
    (dx rounded to it, the sum in fp32, rounded once)."""
    PAD: tl.constexpr = (T0 - 1) + (T1 - 1)
    block, head = tl.program_id(0), tl.program_id(1)
    blocks_per_chunk = tl.cdiv((length + PAD) * batch, BLOCK_ROWS)
    chunk = tl.cast(block // blocks_per_chunk, tl.int64)
    row = (block % blocks_per_chunk) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    valid = row < (length + PAD) * batch
    pos, b = tl.cast(row // batch, tl.int64) - PAD, row % batch
    cols = head * HEAD_DIM + tl.arange(0, HEAD_DIM)
    # grad_y holds positions -(T1 - 1) .. L - 1 of each chunk: a chunk of length L + T1 - 1 starting there
    grad_y = _rows(grad_y_ptr, grad_y_ptr, chunk, pos + (T1 - 1), b, cols, valid, length + T1 - 1, batch, channels,
                   0, False).to(tl.float32)  # fmt: skip
    earlier = _earlier_tokens(offsets_ptr, chunk, pos, b, valid, length, batch) if HAS_DOCS else pos
    grad_x = grad_y * tl.load(w1_ptr + cols * T0 + (T0 - 1)).to(tl.float32)[None, :]
    for j in tl.static_range(T0 - 1):
        later = _rows(grad_y_ptr, grad_y_ptr, chunk, pos + (T1 - 1) + (T0 - 1 - j), b, cols, valid,
                      length + T1 - 1, batch, channels, 0, False).to(tl.float32)  # fmt: skip
        if HAS_DOCS:
            later_earlier = _earlier_tokens(offsets_ptr, chunk, pos + (T0 - 1 - j), b, valid, length, batch)
            later = tl.where((later_earlier >= T0 - 1 - j)[:, None], later, 0.0)
        grad_x += later * tl.load(w1_ptr + cols * T0 + j).to(tl.float32)[None, :]

    partial = partial_ptr + block * ((1 + T0) * channels) + cols
    g = _rows(grad_ptr, grad_ptr, chunk, pos, b, cols, valid, length, batch, channels, 0, False)
    tl.store(partial, tl.sum(g.to(tl.float32), axis=0))
    for j in tl.static_range(T0):
        x = _rows(x_ptr, history_ptr, chunk, pos - (T0 - 1) + j, b, cols, valid, length, batch, channels, PAD,
                  HAS_HISTORY)  # fmt: skip
        if HAS_DOCS:
            x = tl.where((earlier >= T0 - 1 - j)[:, None], x, 0.0)
        tl.store(partial + (1 + j) * channels, tl.sum(grad_y * x.to(tl.float32), axis=0))

    inside = valid & (pos >= 0)
    offsets = ((chunk * length + pos) * batch + b) * channels
    grad_x_ptrs = grad_x_ptr + offsets[:, None] + cols[None, :]
    dx = grad_x.to(grad_x_ptr.dtype.element_ty)
    if ADD_INTO:
        held = tl.load(grad_x_ptrs, mask=inside[:, None], other=0.0)
        dx = (dx.to(tl.float32) + held.to(tl.float32)).to(grad_x_ptr.dtype.element_ty)
    tl.store(grad_x_ptrs, dx, mask=inside[:, None])
    if HAS_HISTORY:
        before = valid & (pos < 0)
        offsets = ((chunk * PAD + PAD + pos) * batch + b) * channels
        tl.store(grad_history_ptr + offsets[:, None] + cols[None, :], grad_x.to(grad_history_ptr.dtype.element_ty),
                 mask=before[:, None])  # fmt: skip


@triton.jit
def _conv_weight_grad_kernel(
    grad_ptr, x_ptr, history_ptr, offsets_ptr, w1_ptr, b1_ptr,
    partial_ptr,  # [programs along axis 2, C, D, T1] fp32
    length, batch, channels, total_rows, rows_per_program,
    T0: tl.constexpr, T1: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    HAS_HISTORY: tl.constexpr, HAS_DOCS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One head's grouped weight gradient for one tap over a span of rows: sum_t g(t)^T y(t - T1 + 1 + tap),
    the depthwise output y recomputed from x."""
    PAD: tl.constexpr = (T0 - 1) + (T1 - 1)
    head, tap, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    d = tl.arange(0, HEAD_DIM)
    cols = head * HEAD_DIM + d
    chunk_rows = length * batch
    acc = tl.zeros([HEAD_DIM, HEAD_DIM], tl.float32)
    first = tl.cast(split, tl.int64) * rows_per_program
    for start in range(first, first + rows_per_program, BLOCK_ROWS):
        row = start + tl.arange(0, BLOCK_ROWS)
        valid = row < total_rows
        chunk, within = row // chunk_rows, row % chunk_rows
        pos, b = within // batch, within % batch
        g = _rows(grad_ptr, grad_ptr, chunk, pos, b, cols, valid, length, batch, channels, 0, False)
        earlier = _earlier_tokens(offsets_ptr, chunk, pos, b, valid, length, batch) if HAS_DOCS else pos
        y = _grouped_input(x_ptr, history_ptr, w1_ptr, b1_ptr, chunk, pos, earlier, T1 - 1 - tap, b, cols, valid,
                           length, batch, channels, T0, PAD, HAS_HISTORY, HAS_DOCS, BLOCK_ROWS, HEAD_DIM)  # fmt: skip
        acc = tl.dot(tl.trans(g), y.to(g.dtype), acc, input_precision=DOT_PRECISION)
    offsets = split * (channels * HEAD_DIM * T1) + cols[:, None] * (HEAD_DIM * T1) + d[None, :] * T1 + tap
    tl.store(partial_ptr + offsets, acc)


@triton.jit
def _conv_param_grads_kernel(
    partial_ptr,  # [depthwise programs, 1 + T0, C] fp32 from _conv_depthwise_grad_kernel
    partial_w_ptr,  # [weight programs along axis 2, C, D, T1] fp32 from _conv_weight_grad_kernel
    w2_ptr,  # [C, D, T1]
    w1_out_ptr, b1_out_ptr, w2_out_ptr, b2_out_ptr,  # [C, T0], [C], [C, D, T1], [C]: gradients or main_grads
    blocks, splits, heads, channels,
    T0: tl.constexpr, T1: tl.constexpr, HEAD_DIM: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """The parameters' gradients from the other kernels' partial sums, one launch for all four: programs
    [0, heads) each sum one head's d b2 and d w1 and derive its d b1; the others each sum a block of d w2."""
    program = tl.program_id(0)
    if program < heads:
        cols = program * HEAD_DIM + tl.arange(0, HEAD_DIM)
        row_length = (1 + T0) * channels
        grad_b2 = column_sums(partial_ptr, blocks, row_length, cols, BLOCK_R)
        store_sum(b2_out_ptr + cols, grad_b2, cols < channels, ACCUMULATE)
        for j in tl.static_range(T0):
            grad_w1 = column_sums(partial_ptr, blocks, row_length, (1 + j) * channels + cols, BLOCK_R)
            store_sum(w1_out_ptr + cols * T0 + j, grad_w1, cols < channels, ACCUMULATE)
        # The depthwise bias reaches every output through every grouped tap (inside a document or as the padding's
        # value), so its gradient is d b2 through the summed grouped taps: d b1[i] = sum_o,t w2[o, i, t] d b2[o].
        for first in range(0, HEAD_DIM, BLOCK_I):
            inputs = first + tl.arange(0, BLOCK_I)  # of the head's channels
            grad_b1 = tl.zeros([BLOCK_I], tl.float32)
            for tap in tl.static_range(T1):
                w = tl.load(w2_ptr + cols[:, None] * (HEAD_DIM * T1) + inputs[None, :] * T1 + tap)  # [out, in]
                grad_b1 += tl.sum(w.to(tl.float32) * grad_b2[:, None], axis=0)
            store_sum(b1_out_ptr + program * HEAD_DIM + inputs, grad_b1, inputs < HEAD_DIM, ACCUMULATE)
    else:
        size = channels * HEAD_DIM * T1
        flat = (program - heads) * BLOCK_W + tl.arange(0, BLOCK_W)  # of d w2 [C, D, T1]
        grad_w2 = column_sums(partial_w_ptr, splits, size, flat, BLOCK_R)
        store_sum(w2_out_ptr + flat, grad_w2, flat < size, ACCUMULATE)


@triton.jit
def _keeps(offsets_ptr, t, b, mask, batch, HAS_DOCS: tl.constexpr):
    """Whether token ``t`` (of the rows in ``mask``) keeps the values shifted into it: with documents, where it does
    not start its document."""
    if HAS_DOCS:
        mask = mask & (tl.load(offsets_ptr + t * batch + b, mask=mask, other=0) > 0)
    return mask


@triton.jit
def _delay_kernel(
    src_ptr,  # [S, B, C] through its strides
    dst_ptr,  # [S, B, C] contiguous
    offsets_ptr,  # [S, B] int32 when HAS_DOCS: tokens before each one in its document
    previous_ptr,  # [n, B, C - first] when HAS_PREVIOUS: the row before each chunk (forward), its gradient (backward)
    length, seq, batch, channels, first,  # S = n chunks of ``length`` tokens (n = 1 without HAS_PREVIOUS)
    stride_s, stride_b, stride_c,
    SHIFT: tl.constexpr,  # -1: channels [first, C) from the token before (forward); +1: from the token after
    HAS_DOCS: tl.constexpr, HAS_PREVIOUS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Channels [0, first) as they are; the others shifted by one token within each chunk, 0 where the pair's later
    token starts the chunk or (with documents) its document: multiplied by 1 or 0, as the reference multiplies.
    With HAS_PREVIOUS a chunk's first token takes the row before the chunk instead of 0; the backward writes that
    row's gradient (the first token's, multiplied the same way)."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # t * B + b
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t, b = rows // batch, rows % batch
    pos = t % length  # in its chunk
    in_seq = rows < seq * batch
    in_range = in_seq[:, None] & (cols < channels)[None, :]
    delayed = (cols >= first)[None, :]
    shift = tl.where(delayed, SHIFT, 0)  # [1, cols]
    inside = in_range & (pos[:, None] + shift >= 0) & (pos[:, None] + shift < length)
    src_cols = b[:, None] * stride_b + cols[None, :] * stride_c
    value = tl.load(src_ptr + tl.cast(t[:, None] + shift, tl.int64) * stride_s + src_cols, mask=inside, other=0.0)
    later = (SHIFT + 1) // 2  # the pair's later token: this one (forward) or the next (backward)
    keep = _keeps(offsets_ptr, t + later, b, in_seq & (pos + later < length), batch, HAS_DOCS)
    if HAS_PREVIOUS:
        starts = in_range & delayed & (pos == 0)[:, None]
        previous = (previous_ptr + (tl.cast(t // length, tl.int64) * batch + b)[:, None] * (channels - first)
                    + (cols - first)[None, :])  # fmt: skip
        if SHIFT < 0:
            value = tl.where(starts, tl.load(previous, mask=starts, other=0.0), value)
        else:
            grad = tl.load(src_ptr + tl.cast(t, tl.int64)[:, None] * stride_s + src_cols, mask=starts, other=0.0)
            kept = _keeps(offsets_ptr, t, b, in_seq, batch, HAS_DOCS)
            tl.store(previous, grad * kept[:, None].to(grad.dtype), mask=starts)
    value = tl.where(delayed, value * keep[:, None].to(value.dtype), value)
    tl.store(dst_ptr + tl.cast(rows, tl.int64)[:, None] * channels + cols[None, :], value, mask=in_range)


# ----------------------------------------------------------------------------------------- autograd


def _rope_strides(cos: torch.Tensor, batch: int) -> tuple[int, int]:
    """(seq, batch) strides of cos/sin [S, rot] or [S, B, rot]; batch stride 0 when shared."""
    shared = cos.dim() == 2 or cos.shape[1] == 1
    return cos.stride(0), 0 if shared else cos.stride(1)


def _meta_params(n_q: int, n_kv: int, head_dim: int, rot: int) -> dict:
    group, half = n_q // n_kv, rot // 2
    return dict(N_KV=n_kv, GROUP=group, HEAD_DIM=head_dim, HALF=half, BLOCK_KV=next_power_of_2(n_kv),
                BLOCK_G=next_power_of_2(group), BLOCK_W=next_power_of_2(max(half, head_dim - rot, 1)),
                num_warps=4)  # fmt: skip


class QKEpilogue(torch.autograd.Function):
    """Steps 2-4 after the convolutions: one kernel each way, every head of a token in one program. ``out``: q and k
    written into these contiguous tensors (shaped as q0 and k0 or as their heads) instead of new ones."""

    @staticmethod
    def forward(ctx, q_conv, k_conv, q0, k0, temp, cos, sin, head_dim, out=None):
        seq, batch = q0.shape[:2]
        n_q, n_kv, rot = q0.shape[-1] // head_dim, temp.numel(), cos.shape[-1]
        q_conv, k_conv, q0, k0, cos, sin = (t.contiguous() for t in (q_conv, k_conv, q0, k0, cos, sin))
        if out is None:
            q, k = torch.empty_like(q0), torch.empty_like(k0)
        else:
            q, k = out[0].view(q0.shape), out[1].view(k0.shape)
        eps = torch.finfo(torch.float32).eps  # the model's, whatever the input dtype
        launch(_qk_epilogue_forward_kernel, (seq * batch,),
            q_conv, k_conv, q0, k0, temp, cos, sin, q, k, batch, *_rope_strides(cos, batch), eps,
            **_meta_params(n_q, n_kv, head_dim, rot),
        )  # fmt: skip
        ctx.save_for_backward(q_conv, k_conv, q0, k0, temp, cos, sin)
        ctx.head_dim = head_dim
        return q, k

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        q_conv, k_conv, q0, k0, temp, cos, sin = ctx.saved_tensors
        seq, batch = q0.shape[:2]
        n_q, n_kv, rot = q0.shape[-1] // ctx.head_dim, temp.numel(), cos.shape[-1]
        grads = [torch.empty_like(t) for t in (q_conv, k_conv, q0, k0)]
        grad_temp = torch.empty((seq * batch, n_kv), dtype=torch.float32, device=q0.device)
        launch(_qk_epilogue_backward_kernel, (seq * batch,),
            grad_q, grad_k, q_conv, k_conv, q0, k0, temp, cos, sin, *grads, grad_temp,
            batch, *_rope_strides(cos, batch), torch.finfo(torch.float32).eps, *grad_q.stride(), *grad_k.stride(),
            **_meta_params(n_q, n_kv, ctx.head_dim, rot),
        )  # fmt: skip
        # the temperature's gradient: summed in fp32, then added into main_grad or returned in its dtype
        targets = main_grad_targets([temp])
        out = torch.empty_like(temp) if targets is None else targets[0]
        block_c = next_power_of_2(n_kv)
        launch(_sum_rows_kernel, (1,), grad_temp, out, seq * batch, n_kv, ACCUMULATE=targets is not None,
               BLOCK_R=max(1, 4096 // block_c), BLOCK_C=block_c)  # fmt: skip
        if targets is None:
            return *grads, out, None, None, None, None
        return *grads, *added_to_main_grad([temp]), None, None, None, None


#: Convolution launches per platform (``utils.platform()``): token rows per program and warps of the forward,
#: of the grouped conv's input gradient, of the depthwise backward, and of the grouped weight gradient (with its
#: software-pipeline depth). Tuned with ``benchmarks/tune_cca_convs.py``.
CONV_TUNING = {
    "cuda": {"rows": 128, "warps": 8, "grouped_rows": 128, "grouped_warps": 4, "depthwise_rows": 64,
             "depthwise_warps": 4, "weight_rows": 32, "weight_warps": 8, "weight_stages": 3},  # H200, 2026-11-30
    "rocm": {"rows": 32, "warps": 4, "grouped_rows": 32, "grouped_warps": 4, "depthwise_rows": 32,
             "depthwise_warps": 4, "weight_rows": 32, "weight_warps": 4, "weight_stages": 2},  # not tuned
    "cpu": {"rows": 16, "warps": 4, "grouped_rows": 16, "grouped_warps": 4, "depthwise_rows": 16,
            "depthwise_warps": 4, "weight_rows": 16, "weight_warps": 4, "weight_stages": 1},  # the interpreter
}  # fmt: skip


def _delay(src: torch.Tensor, first: int, previous: torch.Tensor | None, offsets: torch.Tensor | None,
           shift: int) -> torch.Tensor:
    seq, batch, channels = src.shape
    dst = torch.empty((seq, batch, channels), dtype=src.dtype, device=src.device)
    rows, block_c = 32, min(128, next_power_of_2(channels))
    length = seq if previous is None else seq // previous.shape[0]
    launch(_delay_kernel, (cdiv(seq * batch, rows), cdiv(channels, block_c)),
        src, dst, src if offsets is None else offsets, src if previous is None else previous, length, seq, batch,
        channels, first, *src.stride(), SHIFT=shift, HAS_DOCS=offsets is not None, HAS_PREVIOUS=previous is not None,
        BLOCK_ROWS=rows, BLOCK_C=block_c)  # fmt: skip
    return dst


class DelayChannels(torch.autograd.Function):
    """``ops.cca.delay_channels(v, first, previous, offsets)`` by one kernel each way: ``v [S, B, C]`` (any
    strides), ``previous [n, 1, B, C - first]`` (context parallelism: v is n chunks, each shifted in from its own
    preceding token) or None, ``offsets [S, B]`` int32 or None -> ``[S, B, C]`` contiguous. The backward returns
    the gradients of v and of ``previous``."""

    @staticmethod
    def forward(ctx, v, first, previous, offsets):
        ctx.first, ctx.offsets = first, None if offsets is None else offsets.to(torch.int32).contiguous()
        previous = None if previous is None else previous.to(v.dtype).contiguous()
        ctx.previous_shape = None if previous is None else previous.shape
        return _delay(v, first, previous, ctx.offsets, shift=-1)

    @staticmethod
    def backward(ctx, grad):
        grad_previous = None if ctx.previous_shape is None else grad.new_empty(ctx.previous_shape)
        return _delay(grad, ctx.first, grad_previous, ctx.offsets, shift=1), None, grad_previous, None


def _dot_precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"  # tf32 is ignored by bf16/fp16 dots


class CausalConvs(torch.autograd.Function):
    """``ops.cca.causal_convs`` by the convolution kernels: one launch forward, four backward, no padded copies."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, history, offsets):
        ctx.params = (w1, b1, w2, b2)  # as given: a parameter's main_grad is the parameter's, not a view's
        x, b1, w2, b2 = (t.contiguous() for t in (x, b1, w2, b2))
        w1 = w1.reshape(w1.shape[0], -1).contiguous()  # [C, t0], from [C, t0] or the module's [C, 1, t0]
        history = None if history is None else history.to(x.dtype).contiguous()
        offsets = None if offsets is None else offsets.to(torch.int32).contiguous()
        chunks = 1 if history is None else history.shape[0]
        seq, batch, channels = x.shape
        tuning, head_dim = CONV_TUNING[platform(x.device)], w2.shape[1]
        out = torch.empty_like(x)
        grid = (chunks * cdiv(seq // chunks * batch, tuning["rows"]), channels // head_dim)
        launch(_conv_forward_kernel, grid,
            x, x if history is None else history, x if offsets is None else offsets, w1, b1, w2, b2, out, seq // chunks,
            batch, channels, T0=w1.shape[-1], T1=w2.shape[-1], HEAD_DIM=head_dim, BLOCK_ROWS=tuning["rows"],
            HAS_HISTORY=history is not None, HAS_DOCS=offsets is not None, DOT_PRECISION=_dot_precision(x),
            num_warps=tuning["warps"])  # fmt: skip
        ctx.save_for_backward(x, history, offsets, w1, b1, w2)
        return out

    @staticmethod
    def backward(ctx, grad):
        return CausalConvs.backward_adding(ctx, grad, None)

    @staticmethod
    def backward_adding(ctx, grad, other_grad_x: torch.Tensor | None):
        """:meth:`backward`; given ``other_grad_x`` (another gradient of x, contiguous, in x's dtype), x's gradient
        is added into it, and it is returned as x's: the sum of the two in the launch that makes the first."""
        x, history, offsets, w1, b1, w2 = ctx.saved_tensors
        chunks = 1 if history is None else history.shape[0]
        seq, batch, channels = x.shape
        length, total = seq // chunks, seq * batch
        t0, t1, head_dim = w1.shape[-1], w2.shape[-1], w2.shape[1]
        heads, tuning, precision = channels // head_dim, CONV_TUNING[platform(x.device)], _dot_precision(x)
        history_or_x = x if history is None else history
        offsets_or_x, has_docs = (x, False) if offsets is None else (offsets, True)
        grad = grad.contiguous()

        grad_y = torch.empty((chunks, length + t1 - 1, batch, channels), dtype=x.dtype, device=x.device)
        w2_by_tap = w2.view(heads, head_dim, head_dim, t1).permute(0, 3, 2, 1).contiguous()  # [H, T1, in, out]
        grid = (chunks * cdiv((length + t1 - 1) * batch, tuning["grouped_rows"]), heads)
        launch(_conv_grouped_grad_kernel, grid,
            grad, w2_by_tap, offsets_or_x, grad_y, length, batch, channels, T1=t1, HEAD_DIM=head_dim,
            BLOCK_ROWS=tuning["grouped_rows"], HAS_DOCS=has_docs, DOT_PRECISION=precision,
            num_warps=tuning["grouped_warps"])  # fmt: skip

        grad_x = torch.empty_like(x) if other_grad_x is None else other_grad_x
        if other_grad_x is not None and (other_grad_x.shape != x.shape or other_grad_x.dtype != x.dtype
                                         or not other_grad_x.is_contiguous()):
            raise ValueError(f"the gradient to add x's into must be contiguous like x {tuple(x.shape)} {x.dtype}")
        grad_history = None if history is None else torch.empty_like(history)
        blocks = chunks * cdiv((length + t0 + t1 - 2) * batch, tuning["depthwise_rows"])
        partial = torch.empty((blocks, 1 + t0, channels), dtype=torch.float32, device=x.device)
        launch(_conv_depthwise_grad_kernel, (blocks, heads),
            grad, grad_y, x, history_or_x, w1, offsets_or_x, grad_x, grad_x if history is None else grad_history,
            partial, length, batch, channels, T0=t0, T1=t1, HEAD_DIM=head_dim, BLOCK_ROWS=tuning["depthwise_rows"],
            HAS_HISTORY=history is not None, HAS_DOCS=has_docs, ADD_INTO=other_grad_x is not None,
            num_warps=tuning["depthwise_warps"])  # fmt: skip

        rows = tuning["weight_rows"]
        splits = cdiv(persistent_programs(x.device, cdiv(total, rows) * heads * t1), heads * t1)
        rows_per_program = cdiv(cdiv(total, splits), rows) * rows
        splits = cdiv(total, rows_per_program)
        partial_w = torch.empty((splits, *w2.shape), dtype=torch.float32, device=x.device)
        launch(_conv_weight_grad_kernel, (heads, t1, splits),
            grad, x, history_or_x, offsets_or_x, w1, b1, partial_w, length, batch, channels, total, rows_per_program,
            T0=t0, T1=t1, HEAD_DIM=head_dim, BLOCK_ROWS=rows, HAS_HISTORY=history is not None, HAS_DOCS=has_docs,
            DOT_PRECISION=precision, num_warps=tuning["weight_warps"], num_stages=tuning["weight_stages"])  # fmt: skip

        # d w1, d b1, d w2, d b2: summed in fp32, then added into main_grad or returned in the parameters' dtype
        targets = main_grad_targets(ctx.params)
        outs = targets or [torch.empty_like(p, memory_format=torch.contiguous_format) for p in ctx.params]
        block_w = 128
        launch(_conv_param_grads_kernel, (heads + cdiv(w2.numel(), block_w),),
            partial, partial_w, w2, *outs, blocks, splits, heads, channels, T0=t0, T1=t1, HEAD_DIM=head_dim,
            ACCUMULATE=targets is not None, BLOCK_I=min(head_dim, 32), BLOCK_R=32, BLOCK_W=block_w)  # fmt: skip
        param_grads = outs if targets is None else added_to_main_grad(ctx.params)
        return grad_x, *param_grads, grad_history, None


def causal_qk_convs_fused(x: torch.Tensor, depthwise_w, depthwise_b, grouped_w, grouped_b, heads: int,
                          history: torch.Tensor | None = None, document_offsets: torch.Tensor | None = None
                          ) -> torch.Tensor:
    """``ops.cca.causal_convs`` (same contract) by the Triton kernels, for head sizes :func:`takes_head_dim`."""
    head_dim = grouped_w.shape[1]
    if not takes_head_dim(head_dim) or heads * head_dim != x.shape[-1]:
        raise ValueError(f"causal_qk_convs_fused: {heads} heads of {head_dim} channels (a power of two >= 16) "
                         f"for {x.shape[-1]} channels")
    return CausalConvs.apply(x, depthwise_w, depthwise_b, grouped_w, grouped_b, history, document_offsets)


# ----------------------------------------------------------------------------------------- public API


def runs_on(*tensors: torch.Tensor) -> bool:
    """Whether these kernels run on ``tensors``: all on a GPU, or the kernels are interpreted."""
    return triton_runs(_qk_epilogue_forward_kernel, *tensors)


def takes_head_dim(head_dim: int) -> bool:
    """Whether the convolution kernels take heads of ``head_dim`` channels: a power of two >= 16 (``tl.dot``)."""
    return head_dim >= 16 and not head_dim & (head_dim - 1)


def _check_shapes(q0, k0, wq2, temp, cos, sin) -> None:
    head_dim = wq2.shape[1]
    n_kv = temp.numel()
    problems = []
    if q0.shape[:2] != k0.shape[:2]:
        problems.append(f"q0 {list(q0.shape)} and k0 {list(k0.shape)} differ in [S, B]")
    if q0.shape[-1] % head_dim or (q0.shape[-1] // head_dim) % n_kv:
        problems.append(f"q0 width {q0.shape[-1]} is not a multiple of head_dim {head_dim} x {n_kv} KV heads")
    if k0.shape[-1] != n_kv * head_dim:
        problems.append(f"k0 width {k0.shape[-1]} != {n_kv} KV heads (temp) x head_dim {head_dim} (wq2)")
    rope_batch_ok = cos.dim() == 2 or cos.dim() == 3 and cos.shape[1] in (1, q0.shape[1])
    if cos.shape != sin.shape or cos.shape[0] != q0.shape[0] or not rope_batch_ok or cos.shape[-1] % 2 \
            or cos.shape[-1] > head_dim:
        problems.append(f"cos/sin must be [S, rot] or [S, B, rot] with even rot <= {head_dim}; got {list(cos.shape)}")
    if problems:
        raise ValueError("cca_qk: " + "; ".join(problems))


def cca_qk(q0, k0, wq1, bq1, wk1, bk1, wq2, bq2, wk2, bk2, temp, cos, sin, history=None, document_offsets=None):
    """CCA q/k by the Triton kernels (convolutions, then steps 2-4): q0 [S, B, nq*d], k0 [S, B, nkv*d] -> q
    [S, B, nq, d], k [S, B, nkv, d] in q0's dtype; ``ops.cca.cca_qk`` (fp32) up to rounding.

    Depthwise conv weights wq1 [nq*d, t0], wk1 [nkv*d, t0] (or [., 1, t0], the modules' parameters, so that their
    gradients can go into Megatron's ``main_grad``); grouped wq2 [nq*d, d, t1], wk2 [nkv*d, d, t1];
    biases [channels]; temp [nkv]; cos, sin [S, rot] or [S, B, rot] (NeoX layout: both halves equal);
    ``history [n, t0 + t1 - 2, B, nq*d + nkv*d]``: the pre-conv q0‖k0 before each of n chunks;
    ``document_offsets [S, B]``: see ``ops.cca.causal_convs``.
    """
    _check_shapes(q0, k0, wq2, temp, cos, sin)
    seq, batch = q0.shape[:2]
    head_dim, n_kv = wq2.shape[1], temp.numel()
    n_q = q0.shape[-1] // head_dim
    q_history, k_history = _split_history(history, q0.shape[-1])
    q_conv = causal_qk_convs_fused(q0, wq1, bq1, wq2, bq2, n_q, q_history, document_offsets)
    k_conv = causal_qk_convs_fused(k0, wk1, bk1, wk2, bk2, n_kv, k_history, document_offsets)
    q, k = QKEpilogue.apply(q_conv, k_conv, q0, k0, temp, cos, sin, head_dim)
    return q.view(seq, batch, n_q, head_dim), k.view(seq, batch, n_kv, head_dim)
