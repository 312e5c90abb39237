"""Which optimizer updates which ZAYA1 parameter, and how a Muon parameter is cut into matrices.

ZAYA1 trains its matrices with Muon and everything else with AdamW (architecture notes §5). The rules
below match parameter names *by suffix* (DDP / Float16Module prefixes such as ``module.module.`` are
ignored), first match wins:

================================  ========  ==========================================================
name suffix                       optimizer matrices
================================  ========  ==========================================================
embedding.word_embeddings.weight  AdamW     (tied input embedding / LM head)
output_layer.weight               AdamW
self_attention.linear_q / _k      Muon      one each
self_attention.linear_v           Muon      two: rows [0, R/2) value-current, [R/2, R) value-delayed
                                            (R = global rows; under TP the halves are cut after the TP
                                            gather, so the split point is always global row R/2)
self_attention.linear_proj        Muon      one
self_attention.conv.* / conv_*    AdamW     (3-D conv weights and their biases)
key_temperature                   AdamW
mlp.router.{down_proj,fc1,fc2,    Muon      one each
  out_proj}.weight
mlp.experts.local_experts.K.      Muon      one per expert (``split_gate_up``: gate rows and up rows
  linear_fc1 / linear_fc2                   separately; fc1 rows are [gate; up] per TP shard)
mlp.experts.weight1 / weight2     Muon      grouped experts [E_local, rows, cols]: one per slice
mlp.linear_fc1 / linear_fc2       Muon      dense MLPs (not in ZAYA1; kept for plain GPT models)
any other 1-D parameter           AdamW     norms, residual α/β, EDA scale, router and conv biases
================================  ========  ==========================================================

Any other parameter with two or more dimensions is an error: a new matrix must get a rule here.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from collections.abc import Iterable

import torch

MUON, ADAMW = "muon", "adamw"


@dataclasses.dataclass(frozen=True)
class MatrixLayout:
    """How one Muon parameter splits into independently orthogonalised matrices.

    A parameter of shape [slices, rows, cols] (or [rows, cols] when ``slices == 1``) holds
    ``slices · row_blocks`` matrices of shape [rows / row_blocks, cols] (global shapes, after any TP
    gather). ``blocks_per_tp_shard``: each TP shard stores its own piece of every row block,
    ``[block0_r; block1_r]`` (Megatron's GLU fc1), rather than a contiguous piece of the whole parameter.
    ``expert``: the parameter is TP-sharded over the expert tensor-parallel group.
    """

    slices: int = 1
    row_blocks: int = 1
    blocks_per_tp_shard: bool = False
    expert: bool = False

    @property
    def matrices(self) -> int:
        return self.slices * self.row_blocks


@dataclasses.dataclass(frozen=True)
class Role:
    """The optimizer of one parameter: ``kind`` names it in logs, ``layout`` is set for Muon only."""

    kind: str
    optimizer: str
    layout: MatrixLayout | None = None


# (name-suffix regex, role kind, optimizer); matched against the name without wrapper prefixes.
_RULES: tuple[tuple[str, str, str], ...] = (
    (r"embedding\.word_embeddings\.weight", "embedding", ADAMW),
    (r"output_layer\.weight", "lm_head", ADAMW),
    (r"self_attention\.linear_q\.weight", "attn_q", MUON),
    (r"self_attention\.linear_k\.weight", "attn_k", MUON),
    (r"self_attention\.linear_v\.weight", "attn_v_current_delayed", MUON),
    (r"self_attention\.linear_proj\.weight", "attn_out", MUON),
    (r"self_attention\.conv[._]\w+(\.weight|\.bias)?", "conv", ADAMW),
    (r"key_temperature", "key_temperature", ADAMW),
    (r"mlp\.router\.(down_proj|fc1|fc2|out_proj)\.weight", "router", MUON),
    (r"mlp\.experts\.local_experts\.\d+\.linear_fc1\.weight", "expert_fc1", MUON),
    (r"mlp\.experts\.local_experts\.\d+\.linear_fc2\.weight", "expert_fc2", MUON),
    (r"mlp\.experts\.weight1", "expert_fc1_grouped", MUON),
    (r"mlp\.experts\.weight2", "expert_fc2_grouped", MUON),
    (r"mlp\.linear_fc1\.weight", "dense_fc1", MUON),
    (r"mlp\.linear_fc2\.weight", "dense_fc2", MUON),
)
_COMPILED = tuple((re.compile(rf"(^|\.){pattern}$"), kind, opt) for pattern, kind, opt in _RULES)
_GATED_FC1 = {"expert_fc1", "expert_fc1_grouped"}


def classify(name: str, param: torch.Tensor, *, split_gate_up: bool = False) -> Role:
    """The role of parameter ``name`` (any wrapper prefix) with local tensor ``param``."""
    for pattern, kind, optimizer in _COMPILED:
        if pattern.search(name):
            break
    else:
        if param.dim() <= 1:
            return Role("vector", ADAMW)
        raise ValueError(
            f"ZayaMuon: no optimizer role for parameter {name!r} of shape {tuple(param.shape)}; "
            "add a rule for it to megatron_zaya/optim/roles.py"
        )
    if optimizer == ADAMW:
        return Role(kind, ADAMW)
    return Role(kind, MUON, _layout(name, kind, param, split_gate_up))


def _layout(name: str, kind: str, param: torch.Tensor, split_gate_up: bool) -> MatrixLayout:
    grouped = kind.endswith("_grouped")
    if param.dim() != (3 if grouped else 2):
        raise ValueError(
            f"ZayaMuon: {name!r} should be a {'3-D [experts, rows, cols]' if grouped else '2-D'} matrix "
            f"parameter, got shape {tuple(param.shape)}; check the model's parameter layout"
        )
    slices, expert = (param.shape[0] if grouped else 1), kind.startswith("expert")
    if kind == "attn_v_current_delayed":
        return MatrixLayout(row_blocks=2)
    if kind in _GATED_FC1 and split_gate_up:
        return MatrixLayout(slices=slices, row_blocks=2, blocks_per_tp_shard=True, expert=True)
    return MatrixLayout(slices=slices, expert=expert)


def classify_named_parameters(
    named_params: Iterable[tuple[str, torch.nn.Parameter]], *, split_gate_up: bool = False
) -> dict[torch.nn.Parameter, tuple[str, Role]]:
    """``{param: (name, role)}`` for the trainable parameters (shared params are listed once)."""
    roles: dict[torch.nn.Parameter, tuple[str, Role]] = {}
    for name, param in named_params:
        if param.requires_grad and param not in roles:
            roles[param] = (name, classify(name, param, split_gate_up=split_gate_up))
    return roles


def grouping_table(roles: dict[torch.nn.Parameter, tuple[str, Role]]) -> str:
    """A printable summary: per optimizer and role kind, the tensor, matrix and element counts (local)."""
    rows: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    for param, (_, role) in roles.items():
        row = rows[(role.optimizer, role.kind)]
        row[0] += 1
        row[1] += role.layout.matrices if role.layout else 0
        row[2] += param.numel()
    totals = {opt: sum(r[2] for (o, _), r in rows.items() if o == opt) for opt in (MUON, ADAMW)}
    lines = [
        f"ZayaMuon parameter roles: Muon {_human(totals[MUON])} elements, AdamW {_human(totals[ADAMW])} "
        "(this rank's shards)",
        f"  {'optimizer':9s} {'role':24s} {'tensors':>8s} {'matrices':>9s} {'elements':>10s}",
    ]
    for (opt, kind), (tensors, matrices, numel) in sorted(rows.items()):
        shown = str(matrices) if opt == MUON else "-"
        lines.append(f"  {opt:9s} {kind:24s} {tensors:8d} {shown:>9s} {_human(numel):>10s}")
    return "\n".join(lines)


def _human(n: int) -> str:
    if n < 1000:
        return str(n)
    exponent = min(int(math.log10(n) // 3), 4)
    return f"{n / 1000**exponent:.2f}{' KMGT'[exponent]}"
