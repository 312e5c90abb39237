"""The ZAYA1 layer and block: ``x = merge(x, CCA(norm(x))); x = merge(x, MoE(norm(x), r))`` (docs/architecture.md §2).

``ZayaTransformerLayer`` is built by Megatron's spec system exactly like a ``TransformerLayer`` (its slots
are ``input_layernorm``, ``self_attention`` = CCA, ``self_attn_bda`` = residual scaling,
``pre_mlp_layernorm``, ``mlp`` = ``ZayaMoELayer``, ``mlp_bda`` = residual scaling); only ``forward``
differs, because ZAYA1 keeps the residual stream in fp32 and threads the router state r from layer to layer.
``ZayaTransformerBlock`` adds the input affine after the embedding and the per-layer RoPE table, and
recomputes layers in the backward pass with ``--recompute-granularity full``, those that ``--recompute-method`` and
``--recompute-num-layers`` choose; with ``selective`` the layer recomputes the pieces named by
``--recompute-modules`` (``recompute.py``).

Pipeline parallelism: a stage hands the next one the residual stream *and* the router state of its last layer
(the next layer's EDA input), concatenated on the channel dim into one fp32 tensor ``[s, b, D + R]`` (just
``[s, b, D]`` without EDA), because Megatron's schedules exchange one tensor per micro-batch. Under sequence
parallelism both are split on the sequence dim alike. ``stage_tensor_width`` gives the width; the
``pipeline.stage_tensor_width`` patch makes Megatron's receive buffers that wide.
"""

from __future__ import annotations

from functools import partial

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_layer import TransformerLayer

from ..config import ZayaConfigError
from .cuda_graphs import LayerGraphs, check_cuda_graphs
from .norm import InputScaling, residual_dtype
from .recompute import Recompute, full_recompute_segments, recomputes


def stage_tensor_width(config) -> int:
    """Channels of the tensor between pipeline stages: the residual stream, plus the router state under EDA."""
    return config.hidden_size + (config.router_hidden_size if config.router_eda else 0)


class ZayaTransformerLayer(TransformerLayer):
    """One ZAYA1 block: a CCA sublayer and an MoE sublayer, each merged by residual scaling."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)

    @property
    def attention_type(self) -> str:
        return self.config.attention_types[self.layer_number - 1]

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, router_state=None, **unused):
        """``hidden_states [s, b, D]`` (the residual stream) -> ``(hidden_states, router_state [s, b, R])``."""
        dtype = self.config.params_dtype
        norms = recomputes(self.config, "layernorm", self.training)
        attention_output, residual = self._attention(hidden_states, attention_mask, rotary_pos_emb, norms)
        if self.mlp.takes_the_stream(attention_output, residual, self.self_attn_bda, self.pre_mlp_layernorm):
            mlp_output, residual, router_state = self.mlp.forward_from_stream(
                attention_output, residual, self.self_attn_bda, self.pre_mlp_layernorm, router_state)
            return self.mlp_bda(mlp_output, residual), router_state
        pre_mlp_norm = partial(self.self_attn_bda, norm=self.pre_mlp_layernorm, dtype=dtype)
        if norms:  # the norm's output is dropped until the backward reaches the MoE sublayer
            pre_mlp_norm = Recompute(pre_mlp_norm, [*self.self_attn_bda.parameters(),
                                                    *self.pre_mlp_layernorm.parameters()])
        mlp_input, residual = pre_mlp_norm(attention_output, residual)
        if recomputes(self.config, "moe", self.training) and not self.mlp.runs_as_one_op(mlp_input):
            mlp = Recompute(_count_tokens_once([self], lambda x, router_state: self.mlp(x, router_state=router_state)),
                            self.mlp.parameters())
            mlp_output, router_state = mlp(mlp_input, router_state)
        else:
            mlp_output, router_state = self.mlp(mlp_input, router_state=router_state)
        if norms:
            pre_mlp_norm.drop_outputs(mlp_output)
        return self.mlp_bda(mlp_output, residual), router_state

    def _attention(self, residual, attention_mask, rotary_pos_emb, norms: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The CCA sublayer's output from the residual stream, and the stream for the rest of the layer: with the
        ``cca_sublayer`` op, which normalises the stream itself (and recomputes the norm inside), the stream as the
        op passes it through (its norm's backward then adds the stream's other gradient); else the output computed
        from the input norm's output (dropped until the backward reaches the sublayer where ``norms`` are
        recomputed), and the stream itself."""
        attention = self.self_attention
        if attention.runs_as_one_op(residual, self.input_layernorm):
            output, _, stream = attention(residual, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
                                          input_norm=self.input_layernorm)
            return output, stream
        input_norm = partial(self.input_layernorm, dtype=self.config.params_dtype)
        if norms:
            input_norm = Recompute(input_norm, self.input_layernorm.parameters())
        output, _ = attention(input_norm(residual), attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb)
        if norms:
            input_norm.drop_outputs(output)
        return output, residual


def _count_tokens_once(layers, run):
    """``run`` for activation recomputation: the routers of ``layers`` count their tokens in the first forward only,
    not again when the layers are recomputed during the backward pass."""
    calls = []

    def forward(hidden_states, router_state):
        for layer in layers:
            layer.mlp.router.count_tokens = not calls
        calls.append(True)
        try:
            return run(hidden_states, router_state)
        finally:
            for layer in layers:
                layer.mlp.router.count_tokens = True

    return forward


def _run_in_turn(layers, hidden_states, router_state, attention_mask, rotary_pos_emb):
    """``layers`` one after another; ``rotary_pos_emb`` maps an attention type to its RoPE table."""
    for layer in layers:
        hidden_states, router_state = layer(hidden_states, router_state=router_state, attention_mask=attention_mask,
                                            rotary_pos_emb=rotary_pos_emb[layer.attention_type])
    return hidden_states, router_state


class ZayaTransformerBlock(TransformerBlock):
    """The stack of ZAYA1 layers (of this pipeline stage) and the final RMSNorm."""

    def __init__(self, config, spec, pre_process=True, post_process=True, pg_collection=None, vp_stage=None):
        super().__init__(config=config, spec=spec, pre_process=pre_process, post_process=post_process,
                         pg_collection=pg_collection, vp_stage=vp_stage)
        if pre_process and config.residual_scaling:
            self.input_residual_scaling = InputScaling(config)
        self.cuda_graphs = None
        if config.cuda_graphs:
            check_cuda_graphs(self)
            self.cuda_graphs = LayerGraphs(self.layers)

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb: dict | None = None, **unused):
        """``hidden_states [s, b, D]`` embeddings -> normalised final hidden states ``[s, b, D]``.

        ``rotary_pos_emb`` maps an attention type ("global" / "sliding") to its RoPE table.
        """
        router_state = None
        if not self.pre_process:
            hidden_states, router_state = self._unpack_stage_input(self.input_tensor)
        elif self.config.residual_scaling:
            hidden_states = self.input_residual_scaling(hidden_states)
        else:
            hidden_states = hidden_states.to(residual_dtype(self.config))
        replayed = None
        if self.cuda_graphs is not None and self.training and torch.is_grad_enabled():
            replayed = self.cuda_graphs(hidden_states, router_state, attention_mask, rotary_pos_emb)
        if replayed is None:
            replayed = self._run_layers(hidden_states, router_state, attention_mask, rotary_pos_emb)
        hidden_states, router_state = replayed
        if not self.post_process:
            return self._pack_stage_output(hidden_states, router_state)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states, self.config.params_dtype)
        return hidden_states

    def _run_layers(self, hidden_states, router_state, attention_mask, rotary_pos_emb):
        layers = len(self.layers)
        segments = [(range(layers), False)]
        if self.training and self.config.recompute_granularity == "full":
            segments = full_recompute_segments(layers, self.config.recompute_method, self.config.recompute_num_layers)
        for indices, recomputed in segments:
            segment = [self.layers[index] for index in indices]
            run = partial(_run_in_turn, segment, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb)
            if recomputed:
                hidden_states, router_state = tensor_parallel.checkpoint(
                    _count_tokens_once(segment, run), self.config.distribute_saved_activations, hidden_states,
                    router_state,
                )
            else:
                hidden_states, router_state = run(hidden_states, router_state)
        return hidden_states, router_state

    def _pack_stage_output(self, hidden_states, router_state):
        """``[s, b, D]`` residual and ``[s, b, R]`` router state -> the fp32 stage tensor for the next stage."""
        parts = [hidden_states, router_state] if self.config.router_eda else [hidden_states]
        return torch.cat([part.float() for part in parts], dim=-1)

    def _unpack_stage_input(self, received):
        """The previous stage's tensor -> (residual stream, router state or None)."""
        width, hidden = stage_tensor_width(self.config), self.config.hidden_size
        if received.shape[-1] != width:
            raise ZayaConfigError(f"this pipeline stage received {received.shape[-1]} channels, expected {width} "
                                  "(hidden + router state); enable the pipeline.stage_tensor_width patch")
        # Contiguous, not strided views of the packed rows: the fused kernels index rows as contiguous.
        router_state = received[..., hidden:].contiguous() if self.config.router_eda else None
        return received[..., :hidden].to(residual_dtype(self.config)).contiguous(), router_state
