"""Compressed Convolutional Attention (CCA / CCGQA), ZAYA1's self-attention (docs/architecture.md §3).

Per token x ∈ R^D (shapes for ZAYA1-8B: D=2048, n_q=8 query heads, n_kv=2 KV heads, d=128):

1. down-projections ``q0 = x W_q`` [n_q·d], ``k0 = x W_k`` [n_kv·d] (the "compressed" latent);
2. mean skip terms ``q_res[i] = (q0[i] + k0[kv(i)]) / 2``, ``k_res[j] = mean_{i ∈ group j} q_res[i]``;
3. on the packed ``q0 ‖ k0``: a causal depthwise conv over time (``cca_time0`` taps), then a causal grouped
   conv with one group per head (``cca_time1`` taps, mixing the d channels of a head);
   ``q = conv(q0) + q_res``, ``k = conv(k0) + k_res``;
4. L2 QK-norm to length √d, keys scaled by a learned per-KV-head temperature τ (linear, not exp);
5. partial RoPE (first ``rotary_percent`` of each head, NeoX rotate-half) applied *after* the norm;
6. values ``v = x W_v``: the first half of the value channels from the current token, the second half
   from the previous token (value time-delay; x_{-1} = 0);
7. causal GQA softmax attention (the pluggable ``core_attention``), then ``W_o``.

Tensor parallelism splits by heads: each rank holds n_q/tp query heads with their n_kv/tp KV heads, the
conv channels of those heads, and their value channels. The conv and temperature parameters are raw
``nn.Parameter``s sharded on dim 0, stored separately for the q and k parts so that each TP shard is a
contiguous slice (the checkpoint layout is the same for every TP size). Context parallelism feeds the
convolutions and the value delay the positions just before each of a rank's chunks, and attention the keys
and values of the whole sequence (``context_parallel.py``). Packed documents (``documents.py``) stop all three
mixings, and RoPE's positions, at each document's first token.

Steps 2-6 are ``ops/cca.py``: the torch reference, and the Triton kernels with the ``cca`` kernel op. With the
``cca_sublayer`` op, the layer's input norm and steps 1-6 run as one autograd op over those kernels
(``ops/cca_sublayer.py``), at TP = 1 (with or without context parallelism); the modules and their parameters stay
as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from megatron.core.utils import divide
from torch import nn

from ..ops import cca as cca_ops
from ..ops import cca_sublayer as cca_sublayer_ops
from ..ops.cca import delay_channels
from ..runtime import say_once
from . import documents
from .context_parallel import PrecedingRows, preceding_rows
from .core_attention import SDPAttention
from .module_hooks import call_module_hooks
from .norm import residual_dtype
from .recompute import Recompute, drop_until_gradient, recomputes


class HeadShardedParameters(MegatronModule):
    """Raw parameters split by heads across tensor-parallel ranks (dim 0), checkpointed with global shapes."""

    def __init__(self, config, tp_group, **full_tensors: torch.Tensor):
        super().__init__(config=config)
        self.tp_group = tp_group
        rank, size = tp_group.rank(), tp_group.size()
        for name, full in full_tensors.items():
            local = full.chunk(size, dim=0)[rank].clone().to(config.params_dtype)
            param = nn.Parameter(local)
            tensor_parallel.set_tensor_model_parallel_attributes(param, True, 0, 1)
            self.register_parameter(name, param)

    def forward(self) -> HeadShardedParameters:
        """Itself. The attention calls its parameter holders before reading them: hooks on a module run only
        when it is called, and Megatron's DDP waits for ``--overlap-param-gather``'s all-gather in one."""
        return self

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state = {}
        self._save_to_state_dict(state, "", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(
            state, prefix, {name: 0 for name in state}, sharded_offsets, tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )


@dataclass
class CCASubmodules:
    linear_q: type = ColumnParallelLinear
    linear_k: type = ColumnParallelLinear
    linear_v: type = ColumnParallelLinear
    core_attention: type = SDPAttention
    linear_proj: type = RowParallelLinear


def _conv_init(channels: int, fan_in: int, taps: int, in_per_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's Conv1d default init (U(±1/√fan_in)) for a [channels, in_per_group, taps] weight and its bias."""
    bound = 1.0 / math.sqrt(fan_in)
    weight = torch.empty(channels, in_per_group, taps).uniform_(-bound, bound)
    return weight, torch.empty(channels).uniform_(-bound, bound)


class CompressedConvAttention(MegatronModule):
    """CCA in the ``self_attention`` slot of a Megatron ``TransformerLayer`` (see the module docstring)."""

    def __init__(self, config, submodules: CCASubmodules, layer_number: int,
                 attn_mask_type=AttnMaskType.causal, pg_collection: ProcessGroupCollection | None = None,
                 cp_comm_type=None, pp_layer_offset=None, name=None, **unused):
        super().__init__(config=config)
        pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        tp_size, tp_rank = self.tp_group.size(), self.tp_group.rank()
        d, nq, nkv = config.kv_channels, config.num_attention_heads, config.num_query_groups
        if nkv % tp_size:
            raise ValueError(f"num_query_groups={nkv} is not divisible by tensor parallel size {tp_size}; "
                             "CCA splits KV heads (with their query groups and conv channels) across TP ranks")
        self.head_dim, self.layer_number, self.attn_mask_type = d, layer_number, attn_mask_type
        self.q_heads, self.kv_heads = divide(nq, tp_size), divide(nkv, tp_size)

        def column(spec, out_features, buffer_name):
            return build_module(spec, config.hidden_size, out_features, config=config,
                                init_method=config.init_method, gather_output=False, bias=False,
                                skip_bias_add=False, is_expert=False, tp_comm_buffer_name=buffer_name,
                                tp_group=self.tp_group)

        self.linear_q = column(submodules.linear_q, nq * d, "q")
        self.linear_k = column(submodules.linear_k, nkv * d, "k")
        self.linear_v = column(submodules.linear_v, nkv * d, "v")
        # Value channels at or after global index nkv*d/2 come from the previous token.
        self.first_delayed_channel = min(max(nkv * d // 2 - tp_rank * self.kv_heads * d, 0), self.kv_heads * d)

        t0, t1 = config.cca_time0, config.cca_time1
        q_dw, q_dw_b = _conv_init(nq * d, t0, t0, 1)
        k_dw, k_dw_b = _conv_init(nkv * d, t0, t0, 1)
        q_gr, q_gr_b = _conv_init(nq * d, d * t1, t1, d)
        k_gr, k_gr_b = _conv_init(nkv * d, d * t1, t1, d)
        self.conv = HeadShardedParameters(
            config, self.tp_group,
            q_depthwise_weight=q_dw, q_depthwise_bias=q_dw_b, k_depthwise_weight=k_dw, k_depthwise_bias=k_dw_b,
            q_grouped_weight=q_gr, q_grouped_bias=q_gr_b, k_grouped_weight=k_gr, k_grouped_bias=k_gr_b,
        )
        self.qk_norm = HeadShardedParameters(
            config, self.tp_group, key_temperature=torch.full((nkv,), config.key_temperature_init)
        )
        self.core_attention = build_module(
            submodules.core_attention, config=config, layer_number=layer_number,
            attn_mask_type=attn_mask_type, attention_type="self", cp_comm_type=cp_comm_type,
            softmax_scale=1.0 / math.sqrt(d), pg_collection=pg_collection,
        )
        self.qk = cca_ops.choose(config)
        self.one_op = config.uses_kernel("cca_sublayer") and self._one_op_fits()
        self._one_op_runs: dict[torch.device, bool] = {}
        self.linear_proj = build_module(
            submodules.linear_proj, nq * d, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True,
            skip_bias_add=True, is_expert=False, tp_comm_buffer_name="proj", tp_group=self.tp_group,
        )

    def _call_qk(self, q0, k0, key_temperature, qk_history, *, conv, rotary_pos_emb, **options):
        """The chosen q/k function with its tensors first (what recomputation takes as inputs)."""
        return self.qk(q0, k0, conv, key_temperature, rotary_pos_emb, qk_history=qk_history, **options)

    def _context_parallel_halos(self, q0, k0, v):
        """Under context parallelism: the pre-conv q‖k positions and the delayed value channels of the token(s)
        before each of this rank's two chunks (``qk_history``, ``v_previous``); ``(None, None)`` without CP."""
        cp_group = self.pg_collection.cp
        if cp_group is None or cp_group.size() == 1:
            return None, None
        halo = (self.config.cca_time0 - 1) + (self.config.cca_time1 - 1)
        q_history, k_history, v_previous = preceding_rows(
            [(q0, halo), (k0, halo), (v[..., self.first_delayed_channel:], 1)], cp_group
        )
        return (torch.cat([q_history, k_history], dim=-1) if halo else None), v_previous

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, input_norm=None, **unused):
        """``hidden_states [s(/tp), b, D]`` -> ``(out [s(/tp), b, D], None)``.

        ``attention_mask``: None (one causal sequence), or packed documents: the position ids of the whole
        sequence ``[S, b]`` (``documents.py``); ``rotary_pos_emb`` then holds each token's own angles.
        ``input_norm``: the layer's input norm, when ``hidden_states`` is the residual stream, which the
        ``cca_sublayer`` op normalises itself (where :meth:`runs_as_one_op`); then a third output: the stream as
        the op passes it through, which the layer reads from there on (``ops.cca_sublayer.cca_sublayer``).
        """
        offsets, document_ids, varlen = self._documents(attention_mask)
        stream = None
        if input_norm is None:
            q, k, v, drop_qk = self._qkv(hidden_states, rotary_pos_emb, offsets)
        else:
            q, k, v, drop_qk, stream = self._one_op_qkv(hidden_states, input_norm, rotary_pos_emb, offsets)
        dtype = v.dtype
        attend = partial(self.core_attention, attention_mask=document_ids, attn_mask_type=self.attn_mask_type,
                         packed_seq_params=varlen)
        recompute_attention = recomputes(self.config, "core_attn", self.training)
        if recompute_attention:
            attend = Recompute(attend)
        context = attend(q.to(dtype), k.to(dtype), v)
        output = self.linear_proj(context)
        if drop_qk is not None:
            drop_qk(output[0])
        if recompute_attention:
            attend.drop_outputs(output[0])
        return output if stream is None else (*output, stream)

    def _documents(self, attention_mask):
        """Packed documents' ``(tokens_before [s, b], document ids [S, b], varlen bounds)``: the conv kernels' and
        the value delay's offsets, and the block-masked attention's ids or variable-length attention's bounds."""
        if attention_mask is None:
            return None, None, None
        packed = None
        if not self.config.cuda_graphs:  # graphs warm up and capture the shape-stable block-masked path
            packed = documents.varlen_documents(attention_mask, self.pg_collection.cp)
        if packed is None:  # the block-masked path compares document ids
            return (documents.tokens_before(attention_mask, self.pg_collection.cp),
                    documents.document_ids(attention_mask), None)
        return packed.tokens_before, None, packed.bounds

    def _qkv(self, hidden_states, rotary_pos_emb, offsets):
        """q, k, v for the attention from the normalised ``hidden_states``, one op per kernel, and what frees q
        and k until the backward under ``cca_qk`` recomputation (else None)."""
        q0, _ = self.linear_q(hidden_states)  # [s, b, nq·d / tp]; the sequence is gathered under SP
        k0, _ = self.linear_k(hidden_states)
        v, _ = self.linear_v(hidden_states)
        s, b = q0.shape[:2]
        qk_history, v_previous = self._context_parallel_halos(q0, k0, v)
        conv, qk_norm = self.conv(), self.qk_norm()
        qk = partial(self._call_qk, conv=conv, rotary_pos_emb=rotary_pos_emb, head_dim=self.head_dim,
                     document_offsets=offsets)
        drop_qk = None
        if recomputes(self.config, "cca_qk", self.training):
            qk = Recompute(qk, [*conv.parameters(), *qk_norm.parameters()])
            drop_qk = partial(qk.drop_outputs, which=(0, 1))
        q, k = qk(q0, k0, qk_norm.key_temperature, qk_history)
        v = delay_channels(v, self.first_delayed_channel, v_previous, offsets).view(s, b, self.kv_heads, self.head_dim)
        return q, k, v, drop_qk

    def _one_op_fits(self) -> bool:
        """Whether this layout takes the ``cca_sublayer`` op; says once why not where it does not."""
        if self.tp_group.size() > 1 or self.config.sequence_parallel:
            say_once("the cca_sublayer op runs the CCA sublayer of one rank's heads (TP 1, no sequence "
                     "parallelism); this layout keeps one op per kernel")
        elif residual_dtype(self.config) != torch.float32:
            say_once("the cca_sublayer op normalises an fp32 residual stream; one op per kernel instead")
        else:
            return True
        return False

    def runs_as_one_op(self, residual: torch.Tensor, input_norm) -> bool:
        """Whether :meth:`forward` takes the residual stream and the layer's ``input_norm`` and runs the input norm,
        the projections, the convolutions, the epilogue and the value delay as the ``cca_sublayer`` op."""
        if not self.one_op:
            return False
        if residual.device not in self._one_op_runs:
            self._one_op_runs[residual.device] = cca_sublayer_ops.runs_on(
                residual, self._one_op_weights(input_norm), self.head_dim)
        return self._one_op_runs[residual.device]

    def _one_op_weights(self, input_norm) -> cca_sublayer_ops.CCAWeights:
        """The op's parameters, read in place (:meth:`_one_op_qkv` calls their modules first)."""
        conv = self.conv
        return cca_sublayer_ops.CCAWeights(
            input_norm.weight, self.linear_q.weight, self.linear_k.weight, self.linear_v.weight,
            conv.q_depthwise_weight, conv.q_depthwise_bias, conv.q_grouped_weight, conv.q_grouped_bias,
            conv.k_depthwise_weight, conv.k_depthwise_bias, conv.k_grouped_weight, conv.k_grouped_bias,
            self.qk_norm.key_temperature)

    def _one_op_qkv(self, residual, input_norm, rotary_pos_emb, offsets):
        """As :meth:`_qkv`, from the residual stream by the ``cca_sublayer`` op, its recomputation inside."""
        call_module_hooks(input_norm, self.linear_q, self.linear_k, self.linear_v, self.conv, self.qk_norm)
        recompute_qk = recomputes(self.config, "cca_qk", self.training)
        cp_group = self.pg_collection.cp
        halos = None if cp_group is None or cp_group.size() == 1 else partial(PrecedingRows, cp_group=cp_group)
        settings = cca_sublayer_ops.Settings(input_norm.eps, self.head_dim, self.first_delayed_channel,
                                             recomputes(self.config, "layernorm", self.training), recompute_qk, halos)
        q, k, v, stream, run = cca_sublayer_ops.cca_sublayer(residual, self._one_op_weights(input_norm),
                                                             *cca_ops.rope_cos_sin(rotary_pos_emb), offsets, settings)
        if not recompute_qk:
            return q, k, v, None, stream
        return q, k, v, partial(drop_until_gradient, [q, k], recompute=partial(run.qk_again, (q, k))), stream
