"""The ``--zaya-muon-*`` command-line flags and ``--optimizer zaya_muon``."""

from __future__ import annotations

import argparse

import torch

from megatron_zaya.kernels.newton_schulz import DEFAULT_STEPS, QUINTIC_COEFFICIENTS

from .muon import MuonConfig

OPTIMIZER_NAME = "zaya_muon"
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


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
    group.add_argument("--zaya-muon-momentum", type=float, default=0.95, help="Muon momentum μ (default 0.95).")
    group.add_argument("--zaya-muon-nesterov", action=argparse.BooleanOptionalAction, default=True,
                       help="Nesterov momentum: orthogonalise G + μ·M instead of M (default on).")
    group.add_argument("--zaya-muon-ns-steps", type=int, default=DEFAULT_STEPS,
                       help="Newton–Schulz iterations (default 5).")
    group.add_argument("--zaya-muon-ns-coefficients", default=",".join(map(str, QUINTIC_COEFFICIENTS)),
                       help="Quintic coefficients 'a,b,c' for every step, or one 'a,b,c' per step separated by "
                            "';' (default Keller Jordan's 3.4445,-4.775,2.0315).")
    group.add_argument("--zaya-muon-ns-eps", type=float, default=1e-7,
                       help="Added to the Frobenius norm before normalising (default 1e-7).")
    group.add_argument("--zaya-muon-ns-dtype", choices=sorted(_DTYPES), default="bf16",
                       help="Newton–Schulz compute and communication dtype (default bf16).")
    group.add_argument("--zaya-muon-momentum-dtype", choices=sorted(_DTYPES), default="fp32",
                       help="Muon momentum dtype (default fp32; bf16 halves its memory, see docs/benchmarks.md).")
    group.add_argument("--zaya-muon-update-rms", type=float, default=0.2,
                       help="Update RMS to match AdamW: updates are scaled by this·√max(rows, cols) (default 0.2).")
    group.add_argument("--zaya-muon-kernel", choices=["auto", "torch", "triton"], default="auto",
                       help="Newton–Schulz kernels: Triton symmetric kernels, torch, or auto (Triton on GPU for "
                            "matrices of at least 512 rows and columns).")
    group.add_argument("--zaya-muon-ns-gram", choices=["auto", "off"], default="auto",
                       help="Gram Newton–Schulz (iterate on the m×m Gram matrix, in fp16 with one restart): auto "
                            "uses it on GPUs with a 16-bit --zaya-muon-ns-dtype for matrices where it saves at least "
                            "10%% of the FLOPs (with the Triton kernels: long side >= 1.27x the short one); off keeps "
                            "the standard iteration everywhere.")
    group.add_argument("--zaya-muon-ns-graphs", choices=["auto", "off"], default="auto",
                       help="auto: on GPUs, Newton–Schulz of small batches of matrices (at most 2^23 elements: "
                            "attention and router matrices) replays a CUDA graph captured at the first step, "
                            "instead of launching its ~50 kernels one by one; off: plain launches.")
    group.add_argument("--zaya-muon-split-gate-up", action="store_true",
                       help="Orthogonalise the gate and up halves of each expert's fc1 separately.")
    group.add_argument("--zaya-muon-gather-numel", type=int, default=1 << 28,
                       help="Elements received per all-gather window when sharing updates over data-parallel "
                            "ranks (bounds the receive buffer; default 2^28).")
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
    return MuonConfig(
        momentum=args.zaya_muon_momentum,
        nesterov=args.zaya_muon_nesterov,
        coefficients=parse_coefficients(args.zaya_muon_ns_coefficients, args.zaya_muon_ns_steps),
        eps=args.zaya_muon_ns_eps,
        ns_dtype=_DTYPES[args.zaya_muon_ns_dtype],
        update_rms=args.zaya_muon_update_rms,
        backend=args.zaya_muon_kernel,
        ns_gram=args.zaya_muon_ns_gram,
        ns_graphs=args.zaya_muon_ns_graphs,
        split_gate_up=args.zaya_muon_split_gate_up,
        gather_numel=args.zaya_muon_gather_numel,
        momentum_dtype=_DTYPES[args.zaya_muon_momentum_dtype],
    )


def uses_zero1(args: argparse.Namespace) -> bool:
    """After Megatron's ``validate_args``: whether ``--use-distributed-optimizer`` with ``--optimizer zaya_muon``
    asks for ZeRO-1 (``optim.zero``). Megatron turns the flag into its layer-wise distributed optimizer for any
    optimizer but Adam/SGD; that wiring (``get_model``'s owner-aligned DDP buffers) is what ZeRO-1 builds on."""
    return args.optimizer == OPTIMIZER_NAME and getattr(args, "use_layer_wise_distributed_optimizer", False)
