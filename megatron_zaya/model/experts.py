"""ZAYA1's experts: Megatron's ``SequentialMLP`` of SwiGLU MLPs (one ``linear_fc1`` [2F, D] holding gate then up
rows, one ``linear_fc2`` [D, F] per expert). With the ``experts`` kernel op they run as ``ops/experts.py``'s
grouped experts (two Triton grouped GEMMs around the probability-weighted SwiGLU kernel) instead of
``SequentialMLP``'s loop. The grouped GEMMs read each expert's own weights by address (no stacked copy), so
parameters and checkpoint layout are ``SequentialMLP``'s either way.

The tokens may come in a static-size buffer whose tail belongs to no expert (``ZayaMoELayer``'s single-rank
dispatch: the tokens of the skip class); their output rows are zero.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from ..ops import experts
from .module_hooks import call_module_hooks


class ZayaExperts(SequentialMLP):
    """``SequentialMLP``: ``forward(tokens [N, D] sorted by expert, tokens_per_expert [E_local], probs [N])``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Megatron marks expert weights as reduced over the expert-data-parallel group (``allreduce=False``) only
        # when EP > 1 or expert TP != TP, and only then gives them an optimizer of their own. Marking them in every
        # layout keeps the optimizer's dense/expert split, and so its checkpoint, the same for every EP size:
        # a run saved at EP1 resumes at EP2 with its optimizer state. (At EP1 the expert-data-parallel group is
        # the data-parallel group, so the gradients are reduced over the same ranks either way.)
        for param in self.parameters():
            param.allreduce = False
        self.backends = experts.choose_backends(self.config, self.num_local_experts)
        self.grouped = experts.choose(self.config, self.tp_group.size(), self.backends)  # None: the loop

    def weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The local experts' fc1 ``[2F, D]`` and fc2 ``[D, F]`` weights, for the grouped GEMMs to read in place; their
        modules called for their hooks first."""
        call_module_hooks(*(fc for expert in self.local_experts for fc in (expert.linear_fc1, expert.linear_fc2)))
        return ([expert.linear_fc1.weight for expert in self.local_experts],
                [expert.linear_fc2.weight for expert in self.local_experts])

    def forward(self, permuted_hidden: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor):
        if self.grouped is not None:
            return self.grouped(permuted_hidden, *self.weights(), tokens_per_expert, permuted_probs), None
        routed = int(tokens_per_expert.sum())  # the per-expert loop needs host counts anyway
        if routed == permuted_hidden.shape[0]:
            return super().forward(permuted_hidden, tokens_per_expert, permuted_probs)
        output, bias = super().forward(permuted_hidden[:routed], tokens_per_expert, permuted_probs[:routed])
        return torch.cat([output, output.new_zeros(permuted_hidden.shape[0] - routed, output.shape[-1])]), bias
