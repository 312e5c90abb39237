"""The ``--zaya-muon-*`` command-line flags and ``--optimizer zaya_muon``."""

from __future__ import annotations

import argparse

from megatron_zaya.ops.newton_schulz import DEFAULT_STEPS, QUINTIC_COEFFICIENTS

from ..dataclass_flags import add_flags, values_from_args
from .muon import MuonConfig

OPTIMIZER_NAME = "zaya_muon"


def allow_zaya_muon(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``zaya_muon`` to the choices of the parser's ``--optimizer`` (Megatron's), if it has one."""
    for action in parser._actions:
        if action.dest == "optimizer" and action.choices is not None and OPTIMIZER_NAME not in action.choices:
            action.choices = [*action.choices, OPTIMIZER_NAME]
    return parser


def add_muon_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--zaya-muon-*`` flags; if the parser has Megatron's ``--optimizer``, allow ``zaya_muon``."""
    allow_zaya_muon(parser)
    group = parser.add_argument_group("ZAYA1 Muon (--optimizer zaya_muon)")
    group.add_argument("--zaya-muon-ns-steps", type=int, default=DEFAULT_STEPS,
                       help="Newton–Schulz iterations (default 5).")
    group.add_argument("--zaya-muon-ns-coefficients", default=",".join(map(str, QUINTIC_COEFFICIENTS)),
                       help="Quintic coefficients 'a,b,c' for every step, or one 'a,b,c' per step separated by "
                            "';' (default Keller Jordan's 3.4445,-4.775,2.0315).")
    add_flags(group, MuonConfig, "zaya_muon_")
    return parser


def parse_coefficients(text: str, steps: int) -> tuple[tuple[float, float, float], ...]:
    """``'a,b,c'`` (repeated ``steps`` times) or ``'a1,b1,c1;a2,b2,c2;...'`` (exactly ``steps`` triples)."""
    try:
        triples = [tuple(float(x) for x in part.split(",")) for part in text.split(";") if part.strip()]
    except ValueError as error:
        raise ValueError(f"--zaya-muon-ns-coefficients {text!r}: {error}; expected 'a,b,c' or 'a,b,c;a,b,c;...'")
    if not triples or any(len(t) != 3 for t in triples):
        raise ValueError(f"--zaya-muon-ns-coefficients {text!r}: expected 'a,b,c' or 'a,b,c;a,b,c;...'")
    if steps < 1:
        raise ValueError(f"--zaya-muon-ns-steps must be at least 1, got {steps}")
    if len(triples) == 1:
        return tuple(triples) * steps
    if len(triples) != steps:
        raise ValueError(
            f"--zaya-muon-ns-coefficients gives {len(triples)} triples but --zaya-muon-ns-steps is {steps}; "
            "give one triple for all steps or exactly one per step"
        )
    return tuple(triples)


def muon_config_from_args(args: argparse.Namespace) -> MuonConfig:
    """The ``MuonConfig`` of parsed arguments (``add_muon_args`` must have been called on the parser)."""
    if not hasattr(args, "zaya_muon_momentum"):
        raise ValueError(
            "--optimizer zaya_muon needs the --zaya-muon-* flags: call megatron_zaya.optim.add_muon_args(parser) "
            "in the extra_args_provider"
        )
    return MuonConfig(coefficients=parse_coefficients(args.zaya_muon_ns_coefficients, args.zaya_muon_ns_steps),
                      **values_from_args(MuonConfig, args, "zaya_muon_"))


def uses_zero1(args: argparse.Namespace) -> bool:
    """After Megatron's ``validate_args``: whether ``--use-distributed-optimizer`` with ``--optimizer zaya_muon``
    asks for ZeRO-1 (``optim.zero``). Megatron turns the flag into its layer-wise distributed optimizer for any
    optimizer but Adam/SGD; that wiring (``get_model``'s owner-aligned DDP buffers) is what ZeRO-1 builds on."""
    return args.optimizer == OPTIMIZER_NAME and getattr(args, "use_layer_wise_distributed_optimizer", False)
