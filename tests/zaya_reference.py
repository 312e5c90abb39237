"""The numerical oracle for tests: ``transformers``' ZAYA1 (``ZayaForCausalLM``) with random weights."""

from __future__ import annotations

import torch
from transformers import ZayaConfig as HFZayaConfig
from transformers import ZayaForCausalLM

SMALL = dict(vocab_size=384, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, moe_intermediate_size=40, num_experts=4, router_hidden_size=24,
             max_position_embeddings=128)


def hf_config(**overrides) -> HFZayaConfig:
    kwargs = {**SMALL, **overrides}
    return HFZayaConfig(**kwargs, attn_implementation="eager")


def random_hf_model(config: HFZayaConfig, seed: int = 0, expert_bias: float = 0.0,
                    skip_bias: float = -1.0) -> ZayaForCausalLM:
    """A float32 reference model whose every parameter is random and non-trivial (no α = 1, β = 0 shortcuts).

    ``expert_bias`` / ``skip_bias`` set the balancing biases of the real experts / the skip class.
    """
    torch.manual_seed(seed)
    model = ZayaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                centre = 1.0 if any(k in name for k in ("scale", "norm", "temp", "layernorm")) else 0.0
                param.copy_(centre + 0.3 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) * (0.5 / param.shape[-1] ** 0.5 + 0.02))
        for name, buf in model.named_buffers():
            if name.endswith("balancing_biases"):
                buf.copy_(expert_bias + 0.05 * torch.randn_like(buf))
                buf[-1] = skip_bias
    return model


def calibrate_skip_bias(model: ZayaForCausalLM, input_ids: torch.Tensor) -> None:
    """Set each layer's skip-class bias to the median margin by which the skip class loses on ``input_ids``,
    so that about half of the tokens pick the skip class (layer by layer, since each bias changes what the
    next layer sees)."""
    for layer in model.model.layers:
        gate, captured = layer.mlp.gate, []
        hook = gate.register_forward_hook(lambda mod, args, out: captured.append(out[0].detach()))
        with torch.no_grad():
            model(input_ids)
        hook.remove()
        probs = torch.softmax(captured[0].float(), dim=-1)
        biases = gate.balancing_biases
        margin = (probs[:, :-1] + biases[:-1]).max(dim=-1).values - probs[:, -1]
        biases[-1] = margin.median()
