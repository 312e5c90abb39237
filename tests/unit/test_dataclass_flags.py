"""Flags declared on dataclass fields (``megatron_zaya.dataclass_flags``): the flags generated from ZayaConfig's
fields give back the fields' defaults, and every non-default value a user passes reaches the config."""

from __future__ import annotations

import argparse
import dataclasses

import torch

from megatron_zaya.config import ZayaConfig
from megatron_zaya.dataclass_flags import add_flags, flagged_fields, values_from_args
from megatron_zaya.training.arguments import add_zaya_args, preset_flags


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_flags(parser, ZayaConfig, "zaya_")
    return parser.parse_args(argv)


def test_defaults_round_trip_through_the_flags():
    values = values_from_args(ZayaConfig, _parse([]), "zaya_")
    defaults = {f.name: f.default for f in dataclasses.fields(ZayaConfig)}
    assert values and all(values[name] == defaults[name] for name in values)
    assert "vocab_size" not in values and "attention_types" not in values  # derived at run time


def test_user_values_reach_the_config():
    argv = ["--zaya-cca-time0", "4", "--zaya-no-router-eda", "--zaya-balance-skip-class", "--zaya-skip-mode",
            "identity", "--zaya-lm-head-precision", "param", "--zaya-lm-head-backward", "recompute",
            "--zaya-balancing-betas", "0.8", "0.95", "--zaya-kernels", "router,cca", "--zaya-sliding-window", "128"]
    values = values_from_args(ZayaConfig, _parse(argv), "zaya_")
    assert {k: values[k] for k in (
        "cca_time0", "router_eda", "balance_skip_class", "skip_mode", "lm_head_fp32", "lm_head_grad_in_forward",
        "balancing_betas", "kernels", "sliding_window")} == dict(
        cca_time0=4, router_eda=False, balance_skip_class=True, skip_mode="identity", lm_head_fp32=False,
        lm_head_grad_in_forward=False, balancing_betas=(0.8, 0.95), kernels="router,cca", sliding_window=128)


def test_every_zaya_flag_is_declared_on_a_field_once():
    parser = argparse.ArgumentParser()
    add_zaya_args(parser)
    flags = [f.metadata["flag"] for f in flagged_fields(ZayaConfig)]
    assert len(flags) == len(set(flags))
    assert set(flags) <= {option for action in parser._actions for option in action.option_strings}


def test_preset_flags_use_the_declared_flags():
    flags = preset_flags("zaya1-base")
    assert flags[flags.index("--zaya-router-hidden-size") + 1] == "256"
    assert flags[flags.index("--zaya-skip-mode") + 1] == "identity"
    assert flags[flags.index("--num-experts") + 1] == "16"


def test_muon_flags_give_back_muon_config_defaults_and_user_values():
    from megatron_zaya.optim.args import add_muon_args, muon_config_from_args
    from megatron_zaya.optim.muon import MuonConfig

    parser = add_muon_args(argparse.ArgumentParser())
    assert muon_config_from_args(parser.parse_args([])) == MuonConfig()
    chosen = muon_config_from_args(parser.parse_args(
        ["--no-zaya-muon-nesterov", "--zaya-muon-ns-graphs", "off", "--zaya-muon-momentum-dtype", "bf16",
         "--zaya-muon-kernel", "torch", "--zaya-muon-ns-steps", "2"]))
    assert (chosen.nesterov, chosen.ns_graphs, chosen.momentum_dtype, chosen.backend, len(chosen.coefficients)) == (
        False, False, torch.bfloat16, "torch", 2)


def test_zaya_flags_give_megatron_the_config_values_and_the_rest_is_set_over_them():
    """ZAYA1's fixed Megatron choices are declared once, on ZayaConfig: its Megatron flags parse back to the
    fields' values, and the fields without a flag are set over what Megatron parsed."""
    from megatron.training.arguments import add_megatron_arguments

    from megatron_zaya.dataclass_flags import fixed_megatron_values
    from megatron_zaya.training.arguments import ZAYA_FLAGS

    args = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args(ZAYA_FLAGS)
    fields = {f.name: f for f in dataclasses.fields(ZayaConfig) if "megatron_flag" in f.metadata}
    flagged = {name for name, f in fields.items() if f.metadata["megatron_flag"]}
    dests = {"gated_linear_unit": "swiglu"}  # Megatron derives the field from --swiglu
    parsed = {name: getattr(args, dests.get(name, name)) for name in flagged}
    # Megatron parses a per-layer list for some flags; its validation turns one value into a scalar
    parsed = {name: v[0] if isinstance(v, list) and len(v) == 1 else v for name, v in parsed.items()}
    assert parsed == {name: fields[name].default for name in flagged}
    assert fixed_megatron_values(ZayaConfig) == dict(
        fp32_residual_connection=True, bias_dropout_fusion=False, masked_softmax_fusion=False)
    assert (args.position_embedding_type, args.transformer_impl, args.ckpt_format) == ("rope", "local", "torch_dist")
