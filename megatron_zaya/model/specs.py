"""ZAYA1 as Megatron-Core layer specs, and the model builder.

The layer is a ``TransformerLayer``-shaped spec whose slots hold ZAYA1's modules::

    input_layernorm    RMSNorm (sequence-parallel aware; no TE/apex needed)
    self_attention     CompressedConvAttention  (linear_q/k/v, core_attention, linear_proj slots)
    self_attn_bda      ResidualScaling          (merges the sublayer output into the fp32 residual)
    pre_mlp_layernorm  RMSNorm
    mlp                ZayaMoELayer(router=ZayaRouter, experts=ZayaExperts: Megatron's SequentialMLP of SwiGLU MLPs)
    mlp_bda            ResidualScaling

The core attention is ``ZayaConfig.core_attention``: ``"sdpa"`` (torch, default) or ``"te"`` (Transformer
Engine's fused attention, when importable); the other ops choose their kernels themselves (``megatron_zaya/ops``).
"""

from __future__ import annotations

from functools import partial

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from ..config import ZayaConfig
from .cca import CCASubmodules, CompressedConvAttention
from .core_attention import SDPAttention
from .experts import ZayaExperts
from .layer import ZayaTransformerLayer
from .model import ZayaModel
from .moe import ZayaMoELayer
from .norm import ResidualAdd, ResidualScaling, RMSNorm
from .router import ZayaRouter


def _core_attention(config: ZayaConfig):
    """The module of ``config.core_attention``."""
    if config.core_attention == "sdpa":
        return SDPAttention
    try:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
    except ImportError as error:  # pragma: no cover - depends on the platform
        raise ValueError(f"core_attention='te' needs Transformer Engine ({error}); use 'sdpa'") from error
    return TEDotProductAttention


def get_zaya1_layer_spec(config: ZayaConfig) -> ModuleSpec:
    """The spec of one ZAYA1 layer (a CCA sublayer and an MoE sublayer)."""
    merge = ModuleSpec(module=ResidualScaling if config.residual_scaling else ResidualAdd, params={"config": config})
    experts = partial(ZayaExperts, submodules=LocalSpecProvider().grouped_mlp_modules(False).keywords["submodules"])
    return ModuleSpec(
        module=ZayaTransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=ModuleSpec(
                module=CompressedConvAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=CCASubmodules(core_attention=_core_attention(config)),
            ),
            self_attn_bda=merge,
            pre_mlp_layernorm=RMSNorm,
            mlp=partial(ZayaMoELayer, submodules=MoESubmodules(experts=experts, router=ZayaRouter)),
            mlp_bda=merge,
        ),
    )


def get_zaya1_decoder_block_spec(config: ZayaConfig, vp_stage: int | None = None,
                                 pp_rank: int | None = None) -> TransformerBlockSubmodules:
    """The layers of this pipeline stage (all ZAYA1 layers are alike) and the final RMSNorm."""
    layer = get_zaya1_layer_spec(config)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=RMSNorm)


def build_zaya_model(config: ZayaConfig, pre_process: bool = True, post_process: bool = True,
                     vp_stage: int | None = None, pg_collection=None, parallel_output: bool = True) -> ZayaModel:
    """Build a :class:`ZayaModel` for this rank's pipeline stage (parallel state must be initialised)."""
    pp_rank = pg_collection.pp.rank() if pg_collection is not None and hasattr(pg_collection, "pp") else None
    spec = get_zaya1_decoder_block_spec(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return ZayaModel(config, spec, pre_process=pre_process, post_process=post_process,
                     parallel_output=parallel_output, pg_collection=pg_collection, vp_stage=vp_stage)

