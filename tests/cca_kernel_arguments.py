"""CCA's q/k on the flat arguments of ``kernels/cca.py``'s ``cca_qk``, for the kernel tests: the model's reference
(``ops/cca.py``) and the kernel as ``ops.cca.fused_cca_qk`` calls it, both taking the RoPE angles."""

from __future__ import annotations

from types import SimpleNamespace

from megatron_zaya.ops import cca as ops


def reference(q0, k0, wq1, bq1, wk1, bk1, wq2, bq2, wk2, bk2, temp, angles, history=None, document_offsets=None):
    """``ops.cca.cca_qk`` (fp32, or float64 for float64 inputs) cast to q0's dtype as the model casts it.

    Depthwise weights ``[C, t0]``, grouped ``[C, d, t1]``; ``angles [S, 1 or B, rot]`` (NeoX: both halves equal);
    ``history``, ``document_offsets``: see ``ops.cca.causal_convs``."""
    conv = SimpleNamespace(q_depthwise_weight=wq1.unsqueeze(1), q_depthwise_bias=bq1, q_grouped_weight=wq2,
                           q_grouped_bias=bq2, k_depthwise_weight=wk1.unsqueeze(1), k_depthwise_bias=bk1,
                           k_grouped_weight=wk2, k_grouped_bias=bk2)
    freqs = angles.view(angles.shape[0], -1, 1, angles.shape[-1])  # Megatron's rotary table [S, 1 or B, 1, rot]
    q, k = ops.cca_qk(q0, k0, conv, temp, freqs, head_dim=wq2.shape[1], qk_history=history,
                      document_offsets=document_offsets)
    return q.to(q0.dtype), k.to(q0.dtype)


def kernel(module):
    """``module.cca_qk`` (a kernels/cca.py) with the signature of :func:`reference`: fp32 cos and sin of the angles."""

    def cca_qk(q0, k0, wq1, bq1, wk1, bk1, wq2, bq2, wk2, bk2, temp, angles, history=None, document_offsets=None):
        return module.cca_qk(q0, k0, wq1, bq1, wk1, bk1, wq2, bq2, wk2, bk2, temp, angles.cos(), angles.sin(),
                             history, document_offsets)

    return cca_qk
