"""ZAYA1's experts: Megatron's ``SequentialMLP`` of SwiGLU MLPs (one ``linear_fc1`` [2F, D] holding gate then up
rows, one ``linear_fc2`` [D, F] per expert), under a name of its own so that the ``kernels.zaya_experts``
patch can run them as two grouped GEMMs without touching the experts of other Megatron models. Parameters
and checkpoint layout are ``SequentialMLP``'s either way."""

from __future__ import annotations

from megatron.core.transformer.moe.experts import SequentialMLP


class ZayaExperts(SequentialMLP):
    """``SequentialMLP``: ``forward(tokens [N, D] sorted by expert, tokens_per_expert [E_local], probs [N])``."""
