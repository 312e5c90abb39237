"""CCA (compressed convolutional attention) q/k projection and value time-delay (docs/zaya1-architecture.md §3).

From the pre-conv projections q0 [S, B, nq*d] and k0 [S, B, nkv*d] (g = nq / nkv query heads per KV head):

1. causal convolutions over time, per channel group, exactly as transformers' ``ZayaCCAProjection``: the
   sequence is left-padded once by (t0 - 1) + (t1 - 1) zeros, then a depthwise conv (t0 taps, bias) and a
   per-head grouped conv (each output channel of a head mixes the head's d channels over t1 taps, bias).
   Because the padding comes before both convs, the grouped conv sees the depthwise bias (not zero) at
   the padded positions;
2. mean skip terms: q_res[i] = (q0[i] + k0[i // g]) / 2, k_res[j] = mean of q_res over the g heads of group j;
   q = conv(q0) + q_res, k = conv(k0) + k_res;
3. L2 norm of each head to sqrt(d) (norm clamped at finfo(dtype).eps), then k *= temp[j];
4. rotary embedding (NeoX rotate-half) on dims [0, rot) of every head; dims [rot, d) carry no position.

The convolutions stay in torch (as a batched GEMM, ``causal_qk_convs_gemm``). The Triton kernels fuse
everything after them, steps 2-4, forward and backward: one read of conv(q0), conv(k0), q0, k0 and one write
of q, k per token, with every head of a token in one program (the k skip term needs all g query heads of its
group). In fp32 internally.

The value time-delay is a GEMM plus a one-token shift of 128 channels: plain torch, no kernel.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .utils import triton_runs


# ----------------------------------------------------------------------------------------- references


def causal_qk_convs(x: torch.Tensor, depthwise_w, depthwise_b, grouped_w, grouped_b, heads: int,
                    history: torch.Tensor | None = None) -> torch.Tensor:
    """The CCA convolutions: x [S, B, C] -> [S, B, C]; depthwise_w [C, t0], grouped_w [C, C // heads, t1].

    ``history [n, (t0 - 1) + (t1 - 1), B, C]`` (context parallelism): x is n chunks, each preceded by its
    history instead of zeros.
    """
    pad = (depthwise_w.shape[-1] - 1) + (grouped_w.shape[-1] - 1)
    seq, batch, channels = x.shape
    if history is None:
        chunks, y = 1, F.pad(x.permute(1, 2, 0), (pad, 0))  # [B, C, S + pad]: left zeros, causal
    else:
        chunks = history.shape[0]
        y = torch.cat([history.to(x.dtype), x.view(chunks, seq // chunks, batch, channels)], dim=1)
        y = y.permute(0, 2, 3, 1).reshape(chunks * batch, channels, -1)  # [n·B, C, pad + S/n]
    y = F.conv1d(y, depthwise_w.unsqueeze(1), depthwise_b, groups=channels)
    y = F.conv1d(y, grouped_w, grouped_b, groups=heads)
    return y.view(chunks, batch, channels, -1).permute(0, 3, 1, 2).reshape(seq, batch, channels)


def causal_qk_convs_gemm(x: torch.Tensor, depthwise_w, depthwise_b, grouped_w, grouped_b, heads: int,
                         history: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`causal_qk_convs` in the time-major layout, for GPUs: the depthwise taps as fp32 multiply-adds and
    the grouped conv as one batched GEMM over heads (a head's taps stacked on the contraction dim).

    cuDNN runs the two ``conv1d`` calls in [B, C, S] with NCHW <-> NHWC conversions around each: ~90 launches per
    layer forward + backward on an H200, in a step that is bound by its host's launches. Rounding points are
    the reference's: the depthwise output once to x's dtype, the grouped conv (with its bias) once.
    """
    t0, t1 = depthwise_w.shape[-1], grouped_w.shape[-1]
    pad = (t0 - 1) + (t1 - 1)
    seq, batch, channels = x.shape
    head_dim = channels // heads
    if history is None:
        padded = F.pad(x, (0, 0, 0, 0, pad, 0)).unsqueeze(0)  # [1, pad + S, B, C]: left zeros, causal
    else:
        chunks = history.shape[0]
        padded = torch.cat([history.to(x.dtype), x.view(chunks, seq // chunks, batch, channels)], dim=1)
    length = padded.shape[1] - pad  # positions per chunk
    inner = length + t1 - 1  # depthwise outputs the grouped conv reads (the padding's included)
    accumulate = torch.promote_types(x.dtype, torch.float32)
    w1, b1 = depthwise_w.to(accumulate), depthwise_b.to(accumulate)
    y = torch.addcmul(b1, padded[:, :inner], w1[:, 0])
    for tap in range(1, t0):
        y = torch.addcmul(y, padded[:, tap:tap + inner], w1[:, tap])
    y = y.to(x.dtype).view(*y.shape[:-1], heads, head_dim)  # [n, inner, B, H, d]
    windows = torch.stack([y[:, tap:tap + length] for tap in range(t1)], dim=-2)  # [n, S/n, B, H, t1, d]
    windows = windows.view(-1, heads, t1 * head_dim).transpose(0, 1)  # [H, N, t1·d]
    weight = grouped_w.view(heads, head_dim, head_dim, t1).permute(0, 3, 2, 1).reshape(heads, t1 * head_dim,
                                                                                       head_dim)
    out = torch.baddbmm(grouped_b.view(heads, 1, head_dim).to(x.dtype), windows, weight.to(x.dtype))  # [H, N, d]
    return out.transpose(0, 1).reshape(seq, batch, channels)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def _rope_and_norm_reference(q, k, temp, cos, sin):
    """Steps 3-4 on q [S, B, nq, d], k [S, B, nkv, d]; cos/sin [S, rot] or [S, B, rot]."""
    scale, eps = math.sqrt(q.shape[-1]), torch.finfo(q.dtype).eps
    q = q * (scale / q.norm(dim=-1, keepdim=True).clamp_min(eps))
    k = k * (scale / k.norm(dim=-1, keepdim=True).clamp_min(eps)) * temp.to(k.dtype)[:, None]
    cos, sin = (c.to(q.dtype).reshape(c.shape[0], -1, 1, c.shape[-1]) for c in (cos, sin))  # [S, B or 1, 1, rot]
    rot = cos.shape[-1]

    def rope(x):
        return torch.cat([x[..., :rot] * cos + _rotate_half(x[..., :rot]) * sin, x[..., rot:]], dim=-1)

    return rope(q), rope(k)


def _split_history(history, q_width: int):
    return (None, None) if history is None else (history[..., :q_width], history[..., q_width:])


def cca_qk_reference(q0, k0, wq1, bq1, wk1, bk1, wq2, bq2, wk2, bk2, temp, cos, sin, history=None):
    """CCA q/k: q0 [S, B, nq*d], k0 [S, B, nkv*d] -> q [S, B, nq, d], k [S, B, nkv, d] in q0's dtype.

    Depthwise conv weights wq1 [nq*d, t0], wk1 [nkv*d, t0]; grouped wq2 [nq*d, d, t1], wk2 [nkv*d, d, t1];
    biases [channels]; temp [nkv]; cos, sin [S, rot] or [S, B, rot] (NeoX layout: both halves equal);
    ``history [n, t0 + t1 - 2, B, nq*d + nkv*d]``: the pre-conv q0‖k0 before each of n chunks (see
    :func:`causal_qk_convs`).
    """
    seq, batch = q0.shape[:2]
    n_kv, head_dim = temp.numel(), wq2.shape[1]
    n_q = q0.shape[-1] // head_dim
    q_history, k_history = _split_history(history, q0.shape[-1])
    q_conv = causal_qk_convs(q0, wq1, bq1, wq2, bq2, n_q, q_history).reshape(seq, batch, n_q, head_dim)
    k_conv = causal_qk_convs(k0, wk1, bk1, wk2, bk2, n_kv, k_history).reshape(seq, batch, n_kv, head_dim)
    q_res = (q0.view(seq, batch, n_q, head_dim) + k0.view(seq, batch, n_kv, head_dim).repeat_interleave(
        n_q // n_kv, dim=2)) * 0.5  # fmt: skip
    k_res = q_res.view(seq, batch, n_kv, n_q // n_kv, head_dim).mean(dim=3)
    return _rope_and_norm_reference(q_conv + q_res, k_conv + k_res, temp, cos, sin)


def value_time_delay(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """v = x @ weight.T [S, B, nkv*d] with the second half of the channels taken from the previous token.

    ``weight`` [nkv*d, D] stacks the current-token rows over the delayed rows (transformers'
    ``v_proj_current`` then ``v_proj_delayed``); the delayed half is 0 at t = 0 (the projection has no bias).
    """
    v = F.linear(x, weight)
    half = v.shape[-1] // 2
    delayed = F.pad(v[:-1, ..., half:], (0, 0) * (v.dim() - 1) + (1, 0))
    return torch.cat([v[..., :half], delayed], dim=-1)


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
def _forward_kernel(
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
def _backward_kernel(
    grad_q_ptr, grad_k_ptr,  # [T, nq*d], [T, nkv*d]
    q_conv_ptr, k_conv_ptr, q0_ptr, k0_ptr, temp_ptr, cos_ptr, sin_ptr,
    grad_q_conv_ptr, grad_k_conv_ptr, grad_q0_ptr, grad_k0_ptr,  # like the inputs
    grad_temp_ptr,  # [T, nkv] fp32 per-token partial sums
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
    q_scale = (root_d / tl.maximum(q_norm, eps))[:, :, None]
    k_head_scale = root_d / tl.maximum(k_norm, eps)  # [KV, 1]
    k_scale = k_head_scale[:, :, None]
    kv = tl.arange(0, BLOCK_KV)
    temp = tl.load(temp_ptr + kv, mask=kv < N_KV, other=0.0).to(tl.float32)[:, None, None]

    cos_a, cos_b, sin_a, sin_b = _rope_angles(cos_ptr, sin_ptr, rope_base, rope_mask, HALF)
    # Rotation transposed: gradients w.r.t. the normalised (pre-RoPE) heads.
    do_a = tl.load(grad_q_ptr + q_base, mask=q_rope, other=0.0).to(tl.float32)
    do_b = tl.load(grad_q_ptr + q_base + HALF, mask=q_rope, other=0.0).to(tl.float32)
    gq_a, gq_b = do_a * cos_a + do_b * sin_b, do_b * cos_b - do_a * sin_a
    gq_p = tl.load(grad_q_ptr + q_base + 2 * HALF, mask=q_pass, other=0.0).to(tl.float32)
    do_a = tl.load(grad_k_ptr + k_base, mask=k_rope, other=0.0).to(tl.float32)
    do_b = tl.load(grad_k_ptr + k_base + HALF, mask=k_rope, other=0.0).to(tl.float32)
    gk_a, gk_b = do_a * cos_a + do_b * sin_b, do_b * cos_b - do_a * sin_a
    gk_p = tl.load(grad_k_ptr + k_base + 2 * HALF, mask=k_pass, other=0.0).to(tl.float32)

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


# ----------------------------------------------------------------------------------------- autograd


def _rope_strides(cos: torch.Tensor, batch: int) -> tuple[int, int]:
    """(seq, batch) strides of cos/sin [S, rot] or [S, B, rot]; batch stride 0 when shared."""
    shared = cos.dim() == 2 or cos.shape[1] == 1
    return cos.stride(0), 0 if shared else cos.stride(1)


def _meta_params(n_q: int, n_kv: int, head_dim: int, rot: int) -> dict:
    group, half = n_q // n_kv, rot // 2
    return dict(N_KV=n_kv, GROUP=group, HEAD_DIM=head_dim, HALF=half, BLOCK_KV=triton.next_power_of_2(n_kv),
                BLOCK_G=triton.next_power_of_2(group), BLOCK_W=triton.next_power_of_2(max(half, head_dim - rot, 1)),
                num_warps=4)  # fmt: skip


class _QKEpilogue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_conv, k_conv, q0, k0, temp, cos, sin, head_dim):
        seq, batch = q0.shape[:2]
        n_q, n_kv, rot = q0.shape[-1] // head_dim, temp.numel(), cos.shape[-1]
        q_conv, k_conv, q0, k0, cos, sin = (t.contiguous() for t in (q_conv, k_conv, q0, k0, cos, sin))
        q, k = torch.empty_like(q0), torch.empty_like(k0)
        eps = torch.finfo(q0.dtype).eps
        _forward_kernel[(seq * batch,)](q_conv, k_conv, q0, k0, temp, cos, sin, q, k, batch, *_rope_strides(cos, batch),
                                        eps, **_meta_params(n_q, n_kv, head_dim, rot))  # fmt: skip
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
        _backward_kernel[(seq * batch,)](
            grad_q.contiguous(), grad_k.contiguous(), q_conv, k_conv, q0, k0, temp, cos, sin, *grads, grad_temp,
            batch, *_rope_strides(cos, batch), torch.finfo(q0.dtype).eps, **_meta_params(n_q, n_kv, ctx.head_dim, rot),
        )  # fmt: skip
        return *grads, grad_temp.sum(0).to(temp.dtype), None, None, None


# ----------------------------------------------------------------------------------------- public API


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


def cca_qk(q0, k0, wq1, bq1, wk1, bk1, wq2, bq2, wk2, bk2, temp, cos, sin, history=None):
    """CCA q/k with the Triton epilogue (steps 2-4); same contract as :func:`cca_qk_reference`."""
    _check_shapes(q0, k0, wq2, temp, cos, sin)
    if not triton_runs(_forward_kernel, q0, k0, temp, cos):
        return cca_qk_reference(q0, k0, wq1, bq1, wk1, bk1, wq2, bq2, wk2, bk2, temp, cos, sin, history)
    seq, batch = q0.shape[:2]
    head_dim, n_kv = wq2.shape[1], temp.numel()
    n_q = q0.shape[-1] // head_dim
    q_history, k_history = _split_history(history, q0.shape[-1])
    q_conv = causal_qk_convs_gemm(q0, wq1, bq1, wq2, bq2, n_q, q_history)
    k_conv = causal_qk_convs_gemm(k0, wk1, bk1, wk2, bk2, n_kv, k_history)
    q, k = _QKEpilogue.apply(q_conv, k_conv, q0, k0, temp, cos, sin, head_dim)
    return q.view(seq, batch, n_q, head_dim), k.view(seq, batch, n_kv, head_dim)
