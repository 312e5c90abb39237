"""Muon for ZAYA1: ZayaMuon on every matrix, AdamW on embeddings and vectors.

* ``roles``: which parameter gets which optimizer, and how it is cut into matrices;
* ``muon``: ``ZayaMuon`` (a ``torch.optim.Optimizer``) and ``MuonConfig``;
* ``plan``: Newton–Schulz work items and their FLOP-balanced data-parallel owners;
* ``megatron``: ``get_zaya_muon_optimizer``, the Megatron-Core factory behind ``--optimizer zaya_muon``
  (wired in by the ``optim.zaya_muon`` patch);
* ``args``: ``add_muon_args(parser)``, the ``--zaya-muon-*`` flags.
"""

from .args import OPTIMIZER_NAME, add_muon_args, muon_config_from_args
from .muon import MuonConfig, ZayaMuon
from .roles import MatrixLayout, Role, classify, classify_named_parameters, grouping_table

__all__ = [
    "OPTIMIZER_NAME",
    "MatrixLayout",
    "MuonConfig",
    "Role",
    "ZayaMuon",
    "add_muon_args",
    "classify",
    "classify_named_parameters",
    "get_zaya_muon_optimizer",
    "grouping_table",
    "muon_config_from_args",
]


def get_zaya_muon_optimizer(*args, **kwargs):
    """See ``megatron_zaya.optim.megatron.get_zaya_muon_optimizer`` (imported lazily: it loads Megatron)."""
    from .megatron import get_zaya_muon_optimizer as build

    return build(*args, **kwargs)
