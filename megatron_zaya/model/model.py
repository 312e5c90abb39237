"""The ZAYA1 language model on Megatron-Core: embedding -> ZAYA1 block -> tied LM head.

A ``LanguageModule`` (not a ``GPTModel``: that class builds its own ``TransformerBlock`` and one RoPE table,
while ZAYA1 needs its block, an RoPE θ per attention type, and an fp32 LM head). Megatron's embedding,
output layer, tied-weight handling across pipeline stages, loss and checkpoint code are reused as they are.
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
from .layer import ZayaTransformerBlock


def _refuse_unimplemented_parallelism(pg_collection: ProcessGroupCollection) -> None:
    """PP would run but compute something else (or crash deep inside): refuse it up front."""
    pp = getattr(pg_collection, "pp", None)
    if pp is not None and pp.size() > 1:
        raise ZayaConfigError("ZAYA1 does not implement pipeline parallelism yet (the router state must cross "
                              "stages); use --pipeline-model-parallel-size 1")


class ZayaModel(LanguageModule):
    """``forward(input_ids [b, s], labels=None) -> logits [b, s, V]`` or, with labels, per-token loss [b, s]."""

    def __init__(self, config: ZayaConfig, block_spec, pre_process: bool = True, post_process: bool = True,
                 parallel_output: bool = True, pg_collection: ProcessGroupCollection | None = None,
                 vp_stage: int | None = None):
        super().__init__(config=config, pg_collection=pg_collection)
        _refuse_unimplemented_parallelism(self.pg_collection)
        self.pre_process, self.post_process = pre_process, post_process
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = config.tie_embeddings
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
        embeddings = self.embedding(input_ids=input_ids, position_ids=position_ids) if self.pre_process else None
        seq_len = input_ids.shape[1] * self.pg_collection.cp.size()  # RoPE slices the CP rank's positions
        rotary = {kind: rope(seq_len) for kind, rope in self.rotary_pos_emb.items()}
        hidden = self.decoder(embeddings, attention_mask=attention_mask, rotary_pos_emb=rotary)
        if not self.post_process:
            return hidden

        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        if labels is not None:
            return self.lm_head_loss(hidden, weight, labels)
        return self.lm_logits(hidden, weight).transpose(0, 1).contiguous()

    def lm_logits(self, hidden: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """Logits ``[s, b, V / tp]`` of the final hidden states ``[s, b, D]`` (fp32 with ``lm_head_fp32``)."""
        if self.config.lm_head_fp32:
            weight = (weight if weight is not None else self.output_layer.weight).float()
            hidden = hidden.float()
        logits, _ = self.output_layer(hidden, weight=weight)
        return logits

    def lm_head_loss(self, hidden: torch.Tensor, weight: torch.Tensor | None, labels: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy ``[b, s]``; the ``kernels.zaya_lm_head`` patch fuses it with the matmul."""
        return self.compute_language_model_loss(labels, self.lm_logits(hidden, weight))
