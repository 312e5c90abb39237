"""ZAYA1's MoE sublayer: Megatron's ``MoELayer`` (token dispatchers, experts) with the ZAYA1 router.

Megatron's ``MoELayer.forward(hidden, padding_mask=)`` has no room for the router state that ZAYA1 carries
from one MoE layer to the next (EDA, spec §4.2), so ``ZayaMoELayer.forward`` takes it as an argument and
returns the next one, handing it to the router around the unchanged Megatron forward.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer


class ZayaMoELayer(MoELayer):
    """``forward(x [s, b, D], router_state [s, b, R] | None) -> (out [s, b, D], next router_state)``."""

    def forward(self, hidden_states: torch.Tensor, router_state: torch.Tensor | None = None):
        self.router.state_in = router_state
        output, bias = super().forward(hidden_states)
        assert bias is None
        next_state, skip_gate = self.router.state_out, self.router.skip_gate
        self.router.state_in = self.router.state_out = self.router.skip_gate = None
        if self.config.skip_mode == "identity" and self.config.skip_class:
            # A skipped token passes through scaled by its (unbiased) skip probability.
            output = output + (skip_gate.view(hidden_states.shape[:-1]).unsqueeze(-1) * hidden_states.float()).to(
                output.dtype
            )
        return output, next_state
