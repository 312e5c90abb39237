"""ZAYA1 on Megatron-Core: layer specs, modules and the model builder."""

from .model import ZayaModel
from .specs import build_zaya_model, get_zaya1_decoder_block_spec, get_zaya1_layer_spec

__all__ = ["ZayaModel", "build_zaya_model", "get_zaya1_decoder_block_spec", "get_zaya1_layer_spec"]
