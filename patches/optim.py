"""Patch group ``optim``: megatron-zaya's optimizers inside Megatron's training loop (see registry.py)."""

from __future__ import annotations

from .registry import register, replace_attr


@register("optim.zaya_muon", target="megatron.training.training.get_megatron_optimizer")
def zaya_muon_optimizer() -> None:
    """``--optimizer zaya_muon``: build ZayaMuon (Muon on matrices) + AdamW in ``setup_model_and_optimizer``.

    Replaces the name ``get_megatron_optimizer`` that ``megatron.training.training`` imported (the one
    ``setup_model_and_optimizer`` calls) with a wrapper: for ``config.optimizer == "zaya_muon"`` it calls
    ``megatron_zaya.optim.megatron.get_zaya_muon_optimizer``, for anything else the original.

    Why a patch: Megatron 0.19.2 sends unknown optimizer names to its emerging-optimizer registry, which
    requires the ``emerging-optimizers`` package, treats ZAYA1's 3-D expert weights as non-matrices and
    cannot shard Newton–Schulz per matrix over data-parallel ranks; the factory is not otherwise pluggable.

    Off: ``--zaya-patches``/``ZAYA_PATCHES`` without ``optim`` (then only Megatron's own optimizers work).
    """
    import megatron.training.training as training

    from megatron_zaya.optim.megatron import wrap_get_megatron_optimizer

    replace_attr(training, "get_megatron_optimizer", wrap_get_megatron_optimizer(training.get_megatron_optimizer))
