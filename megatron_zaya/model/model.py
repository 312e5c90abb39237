"""The ZAYA1 language model on Megatron-Core: embedding -> ZAYA1 block -> tied LM head.

A ``LanguageModule`` (not a ``GPTModel``: that class builds its own ``TransformerBlock`` and one RoPE table,
while ZAYA1 needs its block, an RoPE θ per attention type, and an fp32 LM head). Megatron's embedding,
output layer, tied-weight handling across pipeline stages, loss and checkpoint code are reused as they are.

Pipeline parallelism: a later stage gets no tokens, so the RoPE tables' length comes from the tensor the
previous stage sent (see ``layer.py`` for what that tensor holds); the tied embedding and LM head live on the
first and last stage, and Megatron's ``finalize_model_grads`` sums their gradients (its embedding group).
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import ModelType
from torch import nn

from ..config import ZayaConfig, ZayaConfigError
from ..ops import lm_head
from . import documents
from .documents import rotary_table
from .layer import ZayaTransformerBlock


def _check_pipeline(config: ZayaConfig) -> None:
    """Stages exchange the fp32 residual stream and router state: refuse a build that would round them.
    (Megatron's receive buffers are widened for them by the ``pipeline.stage_tensor_width`` patch.)"""
    if config.pipeline_dtype != torch.float32:
        raise ZayaConfigError(f"pipeline_dtype={config.pipeline_dtype} would round the residual stream and router "
                              "state between pipeline stages; set pipeline_dtype=torch.float32")


class ZayaModel(LanguageModule):
    """``forward(input_ids [b, s], labels=None) -> logits [b, s, V]`` or, with labels, per-token loss [b, s]."""

    def __init__(self, config: ZayaConfig, block_spec, pre_process: bool = True, post_process: bool = True,
                 parallel_output: bool = True, pg_collection: ProcessGroupCollection | None = None,
                 vp_stage: int | None = None):
        super().__init__(config=config, pg_collection=pg_collection)
        if self.pg_collection.pp.size() > 1:
            _check_pipeline(config)
        self.pre_process, self.post_process = pre_process, post_process
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = config.tie_embeddings
        self.fused_lm_head = lm_head.choose(config, self.pg_collection.tp.size())  # None: Megatron's head and loss
        self.vocab_size = config.vocab_size
        self.max_sequence_length = config.max_position_embeddings
        self.model_type = ModelType.encoder_or_decoder
        self.vp_stage = vp_stage

        if pre_process:
            self.embedding = LanguageModelEmbedding(
                config=config, vocab_size=config.vocab_size,
                max_sequence_length=config.max_position_embeddings, position_embedding_type="rope",
                tp_group=self.pg_collection.tp,
            )
        bases = {"global": config.rotary_base, "sliding": config.sliding_rotary_base}
        self.rotary_pos_emb = nn.ModuleDict({
            kind: RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=config.rotary_percent,
                                  rotary_base=bases[kind], use_cpu_initialization=config.use_cpu_initialization,
                                  cp_group=self.pg_collection.cp)
            for kind in sorted(set(config.attention_types))
        })
        self.decoder = ZayaTransformerBlock(config, block_spec, pre_process=pre_process,
                                            post_process=post_process, pg_collection=self.pg_collection,
                                            vp_stage=vp_stage)
        if post_process:
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                config.hidden_size, config.vocab_size, config=config, init_method=config.init_method,
                bias=False, skip_bias_add=False, gather_output=not parallel_output,
                skip_weight_param_allocation=pre_process and config.tie_embeddings, tp_group=self.pg_collection.tp,
            )
        if pre_process or post_process:
            self.setup_embeddings_and_output_layer()

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline stages after the first receive their input here (Megatron's schedules call it)."""
        if isinstance(input_tensor, list):
            assert len(input_tensor) == 1, "ZAYA1 stages exchange one tensor"
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None, **unused):
        """Without ``position_ids``, each sequence is one causal stream. With ``position_ids [b, s]``, a sequence
        packs documents, each starting where its position id is 0 (``documents.py``): attention, the CCA
        convolutions and the value delay stay within a document, and RoPE uses these positions. A dense
        ``attention_mask`` is not used (Megatron's loader makes one under ``--reset-attention-mask``)."""
        embeddings = self.embedding(input_ids=input_ids, position_ids=position_ids) if self.pre_process else None
        if position_ids is None:
            seq_len = self.rotary_length(input_ids)
            rotary = {kind: rope(seq_len) for kind, rope in self.rotary_pos_emb.items()}
            sequence_positions = None
        else:
            rotary = {kind: rotary_table(rope.inv_freq, position_ids) for kind, rope in self.rotary_pos_emb.items()}
            sequence_positions = documents.sequence_positions(position_ids, self.pg_collection.cp)
        hidden = self.decoder(embeddings, attention_mask=sequence_positions, rotary_pos_emb=rotary)
        if not self.post_process:
            return hidden

        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        if labels is not None:
            return self.lm_head_loss(hidden, weight, labels)
        return self.lm_logits(hidden, weight).transpose(0, 1).contiguous()

    def rotary_length(self, input_ids: torch.Tensor | None) -> int:
        """Positions the RoPE tables cover: the local sequence length x the CP size (RoPE slices them per CP
        rank). Later pipeline stages have no tokens: their length is the received tensor's, whose sequence
        dim sequence parallelism splits over the TP ranks."""
        if self.pre_process:
            local = input_ids.shape[1]
        else:
            local = self.decoder.input_tensor.shape[0]
            if self.config.sequence_parallel:
                local *= self.pg_collection.tp.size()
        return local * self.pg_collection.cp.size()

    def lm_logits(self, hidden: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """Logits ``[s, b, V / tp]`` of the final hidden states ``[s, b, D]`` (fp32 with ``lm_head_fp32``)."""
        if self.config.lm_head_fp32:
            weight = (weight if weight is not None else self.output_layer.weight).float()
            hidden = hidden.float()
        logits, _ = self.output_layer(hidden, weight=weight)
        return logits

    def lm_head_loss(self, hidden: torch.Tensor, weight: torch.Tensor | None, labels: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy ``[b, s]`` of the final hidden states ``[s, b, D]``.

        With the ``lm_head`` kernel op, ``ops.lm_head``'s fused head and loss: the [tokens, V] logits never exist.
        """
        if self.fused_lm_head is None:
            return self.compute_language_model_loss(labels, self.lm_logits(hidden, weight))
        weight = weight if weight is not None else self.output_layer.weight
        seq, batch, width = hidden.shape
        loss = self.fused_lm_head(hidden.reshape(seq * batch, width), weight.to(hidden.dtype),
                                  labels.transpose(0, 1).reshape(-1),
                                  grad_in_forward=self.config.lm_head_grad_in_forward,
                                  weight_shared=self.pre_process and self.share_embeddings_and_output_weights)
        return loss.view(seq, batch).transpose(0, 1).contiguous()
