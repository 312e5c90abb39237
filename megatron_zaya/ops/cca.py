"""CCA's q/k path and value delay (docs/architecture.md §3, ``model/cca.py``); kernel op ``cca``.

From the pre-conv projections ``q0 [s, b, nq·d]``, ``k0 [s, b, nkv·d]``: causal convolutions over time (a
depthwise conv, then a grouped conv with one group per head), mean skip terms, L2 QK-norm to length √d, the
per-KV-head key temperature and partial RoPE (Megatron's, NeoX rotate-half) after the norm. In fp32: the
reference returns fp32, the kernel its input dtype (the model casts both to the attention dtype).
The value delay (the second half of the value channels from the previous token) is torch only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """``t.float()``, except that float64 stays float64: the tests' oracle is this reference run in float64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def causal_convs(x: torch.Tensor, depthwise_w, depthwise_b, grouped_w, grouped_b, heads: int,
                 history: torch.Tensor | None = None, document_offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Both convolutions on raw weights: x [s, b, C] -> [s, b, C]; depthwise_w [C, t0], grouped_w [C, C // heads, t1]
    (one group per head). The sequence is left-padded once by (t0 - 1) + (t1 - 1) zeros, so the grouped conv sees
    the depthwise bias at the padded positions (transformers' ZayaCCAProjection).

    ``history [n, (t0 - 1) + (t1 - 1), b, C]`` (context parallelism): x is n chunks, each preceded by its history
    instead of zeros. ``document_offsets [s, b]`` (packed documents): each position's earlier tokens in its
    document. Output p takes input p - l0 - l1 (depthwise tap lag l0, grouped tap lag l1) only where
    l0 + l1 <= offset(p), as the document alone after zeros would; the depthwise bias enters every grouped tap.
    """
    t0, t1 = depthwise_w.shape[-1], grouped_w.shape[-1]
    pad = (t0 - 1) + (t1 - 1)
    seq, batch, channels = x.shape
    chunks = 1 if history is None else history.shape[0]
    before = x.new_zeros(1, pad, batch, channels) if history is None else history.to(x.dtype)
    y = torch.cat([before, x.view(chunks, seq // chunks, batch, channels)], dim=1)  # [n, pad + s/n, b, C]
    if document_offsets is None:
        y = y.permute(0, 2, 3, 1).reshape(chunks * batch, channels, -1)  # [n·b, C, pad + s/n]
        y = F.conv1d(y, depthwise_w.unsqueeze(1), depthwise_b, groups=channels)
        y = F.conv1d(y, grouped_w, grouped_b, groups=heads)
        return y.view(chunks, batch, channels, -1).permute(0, 3, 1, 2).reshape(seq, batch, channels)
    offsets, length = document_offsets.view(chunks, seq // chunks, batch, 1), seq // chunks
    head_dim = channels // heads
    out = grouped_b.expand(chunks, length, batch, channels)
    for l1 in range(t1):
        taps = depthwise_b.expand(chunks, length, batch, channels)
        for l0 in range(t0):
            lag = l0 + l1
            taps = taps + y[:, pad - lag: pad - lag + length] * (offsets >= lag) * depthwise_w[:, t0 - 1 - l0]
        by_head = taps.unflatten(-1, (heads, head_dim))
        tap_weight = grouped_w[..., t1 - 1 - l1].view(heads, head_dim, head_dim)  # [head, out, in]
        out = out + torch.einsum("nlbhi,hoi->nlbho", by_head, tap_weight).flatten(-2)
    return out.reshape(seq, batch, channels)


def causal_qk_conv(q0, k0, conv, head_dim: int, history: torch.Tensor | None = None,
                   document_offsets: torch.Tensor | None = None):
    """:func:`causal_convs` on ``q0 ‖ k0``: ``[s, b, Cq], [s, b, Ck] -> [s, b, Cq], [s, b, Ck]`` (no skip terms).
    ``conv`` holds ``{q,k}_{depthwise,grouped}_{weight,bias}`` (depthwise weights ``[C, 1, t0]``, as Conv1d's)."""
    packed = torch.cat([q0, k0], dim=-1)  # [s, b, C]
    weights = [torch.cat([getattr(conv, f"q_{name}"), getattr(conv, f"k_{name}")]).to(packed.dtype)
               for name in ("depthwise_weight", "depthwise_bias", "grouped_weight", "grouped_bias")]
    weights[0] = weights[0].squeeze(1)  # [C, 1, t0] -> [C, t0]
    mixed = causal_convs(packed, *weights, packed.shape[-1] // head_dim, history, document_offsets)
    return mixed[..., : q0.shape[-1]], mixed[..., q0.shape[-1]:]


def rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Megatron's RoPE (unfused, not interleaved): the first ``rot`` channels of each head rotated NeoX-style by
    the angles ``freqs [s, 1 or b, 1, rot]``; the rest pass. Bit for bit ``apply_rotary_pos_emb``'s."""
    rot = freqs.shape[-1]
    x, passed = x[..., :rot], x[..., rot:]
    first, second = torch.chunk(x, 2, dim=-1)
    x = x * torch.cos(freqs).to(x.dtype) + torch.cat((-second, first), dim=-1) * torch.sin(freqs).to(x.dtype)
    return torch.cat((x, passed), dim=-1)


def cca_qk(q0, k0, conv, key_temperature, rotary_pos_emb, *, head_dim: int, qk_history=None, document_offsets=None):
    """Pre-conv projections ``q0 [s,b,nq·d], k0 [s,b,nkv·d]`` -> q ``[s,b,nq,d]``, k ``[s,b,nkv,d]`` in fp32.

    ``conv``: see :func:`causal_qk_conv`; ``key_temperature [nkv]``; ``rotary_pos_emb [s, 1 or b, 1, rot]`` (the
    angles); ``qk_history``, ``document_offsets``: see :func:`causal_convs` (the history of ``q0 ‖ k0``).
    """
    s, b = q0.shape[:2]
    q_heads, kv_heads = q0.shape[-1] // head_dim, k0.shape[-1] // head_dim
    history = None if qk_history is None else _fp32(qk_history)
    q_conv, k_conv = causal_qk_conv(_fp32(q0), _fp32(k0), conv, head_dim, history, document_offsets)

    q0h = _fp32(q0).view(s, b, q_heads, head_dim)
    k0h = _fp32(k0).view(s, b, kv_heads, head_dim)
    group = q_heads // kv_heads
    q_res = (q0h + k0h.repeat_interleave(group, dim=2)) * 0.5
    k_res = q_res.view(s, b, kv_heads, group, head_dim).mean(dim=3)
    q = q_conv.view(s, b, q_heads, head_dim) + q_res
    k = k_conv.view(s, b, kv_heads, head_dim) + k_res

    eps = torch.finfo(torch.float32).eps
    q = q * (math.sqrt(head_dim) / q.norm(dim=-1, keepdim=True).clamp_min(eps))
    k = k * (math.sqrt(head_dim) / k.norm(dim=-1, keepdim=True).clamp_min(eps))
    k = k * _fp32(key_temperature)[None, None, :, None]
    return rope(q, rotary_pos_emb), rope(k, rotary_pos_emb)


def delay_channels(v: torch.Tensor, first_delayed: int, previous: torch.Tensor | None = None,
                   document_offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Shift channels ``[first_delayed:]`` of ``v [s, b, C]`` one token later (zeros at t=0).

    ``previous [n, 1, b, C - first_delayed]`` (context parallelism): ``v`` is ``n`` chunks, each shifted in
    from its own preceding token. ``document_offsets [s, b]`` (packed documents): zeros at each document's first
    token (offset 0).
    """
    if first_delayed >= v.shape[-1]:
        return v
    current, delayed = v[..., :first_delayed], v[..., first_delayed:]
    if previous is None:
        delayed = F.pad(delayed[:-1], (0, 0, 0, 0, 1, 0))
    else:
        chunks = delayed.view(previous.shape[0], -1, *delayed.shape[1:])
        delayed = torch.cat([previous, chunks[:, :-1]], dim=1).flatten(0, 1)
    if document_offsets is not None:
        delayed = delayed * (document_offsets > 0)[..., None].to(delayed.dtype)
    return torch.cat([current, delayed], dim=-1)


# ----------------------------------------------------------------------------------------- the Triton kernels


def fused_cca_qk(q0, k0, conv, key_temperature, rotary_pos_emb, *, head_dim: int, qk_history=None,
                 document_offsets=None):
    """:func:`cca_qk` as two Triton passes (``kernels/cca.py``: both convolutions, then the epilogue), returning q
    and k in q0's dtype, where the kernels run (GPU tensors or interpreted, a head size they take); else the
    reference. The RoPE angles are Megatron's rotary table (per sequence with packed documents)."""
    from ..kernels import cca as kernel  # imported when first called: triton only where a kernel is chosen

    if not (kernel.runs_on(q0, k0, key_temperature) and kernel.takes_head_dim(head_dim)):
        return cca_qk(q0, k0, conv, key_temperature, rotary_pos_emb, head_dim=head_dim, qk_history=qk_history,
                      document_offsets=document_offsets)
    return kernel.cca_qk(q0, k0, conv.q_depthwise_weight, conv.q_depthwise_bias,
                         conv.k_depthwise_weight, conv.k_depthwise_bias, conv.q_grouped_weight,
                         conv.q_grouped_bias, conv.k_grouped_weight, conv.k_grouped_bias, key_temperature,
                         *rope_cos_sin(rotary_pos_emb), qk_history, document_offsets)


_COS_SIN = WeakIdKeyDictionary()  # Megatron's rotary table -> (its version, cos, sin)


def rope_cos_sin(rotary_pos_emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and sin of the angles of Megatron's rotary table ``[s, 1 or b, 1, rot]`` as ``[s, 1 or b, rot]``:
    computed once per table and version, since every layer of a forward (and its recomputation) shares the table
    and Megatron keeps it from step to step for one sequence length. Inside a CUDA-graph capture they are always
    computed: a replay must recompute them from the graph's table, which is refilled in place."""
    capturing = rotary_pos_emb.is_cuda and torch.cuda.is_current_stream_capturing()
    cached = None if capturing else _COS_SIN.get(rotary_pos_emb)
    if cached is None or cached[0] != rotary_pos_emb._version:
        angles = rotary_pos_emb[:, :, 0, :].float()
        cached = (rotary_pos_emb._version, angles.cos(), angles.sin())
        if not capturing:
            _COS_SIN[rotary_pos_emb] = cached
    return cached[1:]


def choose(config):
    """The q/k function of CCA layers of ``config``: the kernels with the ``cca`` op, else the reference."""
    return fused_cca_qk if config.uses_kernel("cca") else cca_qk
