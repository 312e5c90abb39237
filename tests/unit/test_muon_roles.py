"""Parameter roles, the data-parallel work plan and the ``--zaya-muon-*`` flags."""

from __future__ import annotations

import argparse
import re

import pytest
import torch

from megatron_zaya.optim import MuonConfig, add_muon_args, classify, classify_named_parameters, grouping_table
from megatron_zaya.optim.args import muon_config_from_args
from megatron_zaya.optim.plan import assign_owners, build_items
from megatron_zaya.optim.roles import ADAMW, MUON, MatrixLayout

BRIEF = {  # the names the model uses (issue text), with their expected optimizer and matrix count
    "embedding.word_embeddings.weight": ((64, 8), ADAMW, 0),
    "output_layer.weight": ((64, 8), ADAMW, 0),
    "decoder.layers.3.self_attention.linear_q.weight": ((16, 8), MUON, 1),
    "decoder.layers.3.self_attention.linear_k.weight": ((4, 8), MUON, 1),
    "decoder.layers.3.self_attention.linear_v.weight": ((4, 8), MUON, 2),
    "decoder.layers.3.self_attention.linear_proj.weight": ((8, 16), MUON, 1),
    "decoder.layers.3.self_attention.conv_qk.weight": ((12, 4, 2), ADAMW, 0),
    "decoder.layers.3.self_attention.conv_qk.bias": ((12,), ADAMW, 0),
    "decoder.layers.3.self_attention.conv.q_grouped_weight": ((12, 4, 2), ADAMW, 0),
    "decoder.layers.3.self_attention.qk_norm.key_temperature": ((2,), ADAMW, 0),
    "decoder.layers.3.mlp.router.down_proj.weight": ((6, 8), MUON, 1),
    "decoder.layers.3.mlp.router.fc1.weight": ((6, 6), MUON, 1),
    "decoder.layers.3.mlp.router.fc2.weight": ((6, 6), MUON, 1),
    "decoder.layers.3.mlp.router.out_proj.weight": ((5, 6), MUON, 1),
    "decoder.layers.3.mlp.router.down_proj.bias": ((6,), ADAMW, 0),
    "decoder.layers.3.mlp.router.eda_scale": ((6,), ADAMW, 0),
    "decoder.layers.3.mlp.router.norm.weight": ((6,), ADAMW, 0),
    "decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight": ((10, 8), MUON, 1),
    "decoder.layers.3.mlp.experts.local_experts.7.linear_fc2.weight": ((8, 5), MUON, 1),
    "decoder.layers.3.mlp.experts.weight1": ((4, 10, 8), MUON, 4),
    "decoder.layers.3.mlp.experts.weight2": ((4, 8, 5), MUON, 4),
    "decoder.layers.3.input_layernorm.weight": ((8,), ADAMW, 0),
    "decoder.layers.3.self_attn_bda.residual_scale": ((8,), ADAMW, 0),
    "decoder.layers.3.mlp_bda.hidden_states_bias": ((8,), ADAMW, 0),
    "decoder.input_residual_scaling.scale": ((8,), ADAMW, 0),
    "decoder.final_layernorm.weight": ((8,), ADAMW, 0),
}


@pytest.mark.parametrize("prefix", ["", "module.module."])
def test_roles_of_the_model_names(prefix):
    for name, (shape, optimizer, matrices) in BRIEF.items():
        role = classify(prefix + name, torch.empty(shape))
        assert role.optimizer == optimizer, name
        assert (role.layout.matrices if role.layout else 0) == matrices, name


def test_split_gate_up_doubles_expert_fc1_matrices():
    fc1 = classify("mlp.experts.local_experts.0.linear_fc1.weight", torch.empty(10, 8), split_gate_up=True)
    grouped = classify("mlp.experts.weight1", torch.empty(4, 10, 8), split_gate_up=True)
    assert (fc1.layout.matrices, grouped.layout.matrices) == (2, 8)
    assert fc1.layout.blocks_per_tp_shard and fc1.layout.expert


def test_unknown_matrix_and_wrong_rank_are_errors():
    with pytest.raises(ValueError, match=r"no optimizer role for parameter 'decoder.layers.0.mystery.weight'.*roles"):
        classify("decoder.layers.0.mystery.weight", torch.empty(4, 4))
    with pytest.raises(ValueError, match="should be a 2-D matrix"):
        classify("self_attention.linear_q.weight", torch.empty(4, 4, 2))
    assert classify("decoder.layers.0.some_new_gain", torch.empty(4)).optimizer == ADAMW


def test_roles_cover_the_zaya_model():
    """Every parameter of the real (small) ZAYA1 Megatron model has a role; the counts are per layer."""
    from megatron_zaya.config import preset, zaya_config
    from megatron_zaya.pretrained import build_single_process_model

    cfg = zaya_config("test", use_cpu_initialization=True, moe_token_dispatcher_type="allgather")
    roles = classify_named_parameters(build_single_process_model(cfg).named_parameters())
    kinds = [role.kind for _, role in roles.values()]
    layers, experts = preset("test")["num_layers"], preset("test")["num_moe_experts"]
    for kind, per_layer in [("attn_q", 1), ("attn_k", 1), ("attn_v_current_delayed", 1), ("attn_out", 1),
                            ("router", 4), ("expert_fc1", experts), ("expert_fc2", experts), ("conv", 8)]:
        assert kinds.count(kind) == per_layer * layers, kind
    assert kinds.count("embedding") == 1
    for param, (name, role) in roles.items():
        assert (role.optimizer == MUON) == (param.dim() == 2 and "embedding" not in name), name
    table = grouping_table(roles)
    assert re.search(rf"muon\s+expert_fc1\s+{experts * layers}\s+{experts * layers}\s", table), table
    assert re.search(rf"muon\s+attn_v_current_delayed\s+{layers}\s+{2 * layers}\s", table), table


def _items(shapes, tp_size=1, layouts=None, attrs=None):
    params = [torch.nn.Parameter(torch.empty(s)) for s in shapes]
    for p, a in zip(params, attrs or [{}] * len(params)):
        for k, v in a.items():
            setattr(p, k, v)
    layouts = {params[i]: lay for i, lay in (layouts or {}).items()}
    return build_items([{"params": params}], layouts, tp_size, tp_size)


@pytest.mark.parametrize("dp", [2, 3, 4, 8])
def test_owners_balance_newton_schulz_flops(dp):
    shapes = [(64, 32), (16, 32), (32, 64), (8, 4, 32, 64), (32, 16)]
    items = _items([s if len(s) < 4 else s[1:] for s in shapes])
    owned = assign_owners(items, dp, steps=5)
    load = [sum(i.flops(5) for i in owned if i.owner == r) for r in range(dp)]
    biggest = max(i.flops(5) for i in owned)
    assert sum(load) == pytest.approx(sum(i.flops(5) for i in items))
    assert max(load) <= sum(load) / dp + biggest  # the greedy bound
    assert owned == assign_owners(items, dp, steps=5)  # every rank computes the same plan
    assert {i.owner for i in owned} == set(range(min(dp, len(items))))


def test_items_use_global_shapes_under_tensor_parallelism():
    tp = {"tensor_model_parallel": True, "partition_dim": 0, "partition_stride": 1}
    row_tp = {**tp, "partition_dim": 1}
    grouped_tp = {**tp, "partition_dim": 2}
    items = _items([(8, 12), (12, 8), (3, 12, 4)], tp_size=2, attrs=[tp, row_tp, grouped_tp],
                   layouts={0: MatrixLayout(row_blocks=2), 2: MatrixLayout(slices=3)})  # fmt: skip
    assert [(i.tp_dim, i.global_shape, i.block_shape) for i in items[:2]] == [(0, (16, 12), (8, 12)),
                                                                             (1, (12, 16), (12, 16))]
    assert [(i.slice_index, i.tp_dim, i.global_shape) for i in items[2:]] == [(s, 1, (12, 8)) for s in range(3)]
    assert items[0].update_scale(0.2) == pytest.approx(0.2 * 12**0.5)


def test_a_strided_shard_is_planned_only_where_its_interleave_is_the_row_blocks():
    """Megatron's GLU fc1 under TP (stride 2): whole matrices and one block per interleaved piece are planned;
    row blocks that cut across the interleave are refused."""
    glu = {"tensor_model_parallel": True, "partition_dim": 0, "partition_stride": 2}
    whole, per_piece = MatrixLayout(), MatrixLayout(row_blocks=2, blocks_per_tp_shard=True)
    items = _items([(8, 12), (8, 12)], tp_size=2, attrs=[glu, glu], layouts={0: whole, 1: per_piece})
    assert [(i.global_shape, i.block_shape) for i in items] == [((16, 12), (16, 12)), ((16, 12), (8, 12))]
    with pytest.raises(ValueError, match="stride 2 cannot be cut into 2 row blocks"):
        _items([(8, 12)], tp_size=2, attrs=[glu], layouts={0: MatrixLayout(row_blocks=2)})


def test_flags_give_the_config():
    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    add_muon_args(parser)
    assert muon_config_from_args(parser.parse_args([])) == MuonConfig()
    args = parser.parse_args("--optimizer zaya_muon --zaya-muon-momentum 0.9 --no-zaya-muon-nesterov "
                             "--zaya-muon-ns-steps 2 --zaya-muon-ns-coefficients 3,-3,1;1.5,-0.5,0 "
                             "--zaya-muon-ns-dtype fp32 --zaya-muon-split-gate-up".split())  # fmt: skip
    config = muon_config_from_args(args)
    assert args.optimizer == "zaya_muon"
    assert (config.momentum, config.nesterov, config.ns_dtype, config.split_gate_up) == (0.9, False, torch.float32,
                                                                                           True)
    assert config.coefficients == ((3.0, -3.0, 1.0), (1.5, -0.5, 0.0))
    args = parser.parse_args("--zaya-muon-ns-steps 3 --zaya-muon-ns-coefficients 1,2,3".split())
    assert muon_config_from_args(args).coefficients == ((1.0, 2.0, 3.0),) * 3
    with pytest.raises(ValueError, match="gives 2 triples but --zaya-muon-ns-steps is 5"):
        muon_config_from_args(parser.parse_args(["--zaya-muon-ns-coefficients", "1,2,3;4,5,6"]))
    with pytest.raises(ValueError, match="call megatron_zaya.optim.add_muon_args"):
        muon_config_from_args(argparse.Namespace())


def test_megatron_accepts_optimizer_zaya_muon(monkeypatch):
    """With the ``optim`` patches, Megatron's own parser (re-run inside ``pretrain()``) takes the choice,
    and its optimizer factory hands ``zaya_muon`` to ours."""
    from megatron.training import arguments, training

    from megatron_zaya.patches import apply_patches

    apply_patches("optim")
    monkeypatch.setattr("sys.argv", ["prog", "--optimizer", "zaya_muon", "--zaya-muon-momentum", "0.9"])
    assert arguments.parse_args(ignore_unknown_args=True).optimizer == "zaya_muon"
    calls = []
    monkeypatch.setattr("megatron_zaya.optim.megatron.get_zaya_muon_optimizer", lambda *a, **k: calls.append(a))
    config = argparse.Namespace(optimizer="zaya_muon")
    training.get_megatron_optimizer(config, ["chunk"])
    assert calls == [(config, ["chunk"])]


def test_distributed_optimizer_flag_means_zaya_muon_zero1():
    from megatron_zaya.optim.args import uses_zero1

    # Megatron's validate_args turns --use-distributed-optimizer into its layer-wise wiring for zaya_muon
    assert uses_zero1(argparse.Namespace(optimizer="zaya_muon", use_layer_wise_distributed_optimizer=True))
    assert not uses_zero1(argparse.Namespace(optimizer="zaya_muon", use_layer_wise_distributed_optimizer=False))
    assert not uses_zero1(argparse.Namespace(optimizer="muon", use_layer_wise_distributed_optimizer=True))

