"""Per-GPU memory plan of a ``zaya-pretrain`` command, without building the model: ``zaya-pretrain ...
--zaya-memory-plan [WORLD_SIZE]`` prints it and exits.

The plan counts the parameters each rank holds (TP, PP, EP and the data-parallel sharding of the optimizer from
the flags), multiplies them by the bytes each kind of state takes (``STATE_BYTES``, the one place to adjust),
and adds the activations a micro-batch saves for the backward: per layer, the tensors of ``layer_terms`` (the
tensors ZAYA1's operations save, per token, per sequence position and per layer, and which
``--recompute-modules`` piece drops each one), the LM head, what CUDA graphs keep reserved, and the optimizer step's
transient. Its peak is the larger of the backward's (state + activations + LM-head gradients) and the step's
(state + transient). ``benchmarks/memory_check.py`` runs a short training on a GPU and prints the measured peak
beside this plan.

Activations come in two sets: ``kernels`` (the Triton kernels applied on GPUs: what their ``save_for_backward``
keep) and ``torch`` (the eager operations, on CPU), each checked against the tensors a layer really saves
(tests/unit/test_memory_plan.py: on CPU for ``torch``; the GPU check for ``kernels``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

GIB = 2**30

# ---- bytes per parameter held between steps. Adjust here when the optimizer's layout changes. ----------------
STATE_BYTES = {
    "weight": 2,  # bf16 (4 without --bf16)
    "grad": 4,  # fp32 main_grad buffer; 2 with --grad-reduce-in-bf16
    "muon_master": 4,  # fp32 master weight of a Muon matrix: / DP with --use-distributed-optimizer
    "muon_momentum": 4,  # fp32 momentum: 2 with --zaya-muon-momentum-dtype bf16; / DP with --use-distributed-optimizer
    "adamw_state": 12,  # fp32 master + exp_avg + exp_avg_sq: / DP with --use-distributed-optimizer
}
# The optimizer step's temporaries, per parameter of the rank. Today's zaya_muon step converts whole-model
# gradients: 137.0 vs 120.3 thousand MiB (peak vs between steps) for ZAYA1-8B on one H200 is 1.98 B/param.
STEP_TRANSIENT_BYTES = {"zaya_muon": 2.0, "adam": 0.0, "sgd": 0.0}
# Under ZeRO-1 (--use-distributed-optimizer) the whole-model stream of Muon's updates does not exist: the step holds
# Megatron's fp32 copy of the AdamW shard's gradients where they are bf16 (4 B per AdamW parameter of the shard)
# and one batch of matrices through Newton–Schulz at a time (its fp32 Nesterov update, the 16-bit operands and
# result: ~16 B per element of a batch of optim/muon.py's NS_BATCH_NUMEL). Read from the code, not measured
# alone; on one H200 the 40-layer model's step stayed below the backward's peak (97.9 GiB, 87.7 between steps).
ZERO1_ADAMW_GRAD_BYTES = 4
ZERO1_MUON_BATCH_BYTES_PER_ELEMENT = 16
# --zaya-cuda-graphs: what a graphed run keeps reserved beyond its saved activations (which live in the graphs'
# pool), apart from the chain's static inputs and outputs. It does not grow with depth: most of it is the fused LM
# head's own pool of [V, D] and [chunk, V] temporaries and the gradient clipping's temporaries
# (``python -m benchmarks.memory_phases``). Fitted per element of the LM head's weight on ZAYA1-8B at 16 layers,
# micro-batch 4 (an H100): with 16 B the plan is 0.8% above its reserved peak. (34 B before the head had its pool,
# when its temporaries split the general cache: a fit to 40 layers at micro-batches 2 and 4 on an H200 and to the
# same 16-layer run.)
GRAPH_RESERVE_BYTES_PER_HEAD_ELEMENT = 16
RESERVE_GIB = 2.0  # per GPU, outside torch's allocations: CUDA/ROCm context, NCCL/RCCL buffers, fragmentation
# --async-save: Megatron's background writer is a second process on the GPU (its own CUDA context; it allocates
# no copy of the state, which a thread of the trainer stages to host memory and writes). 518 MiB at its peak on an
# H200 when it read device copies (benchmarks/checkpoint_save.py, docs/benchmarks.md "Checkpoint saves").
ASYNC_WRITER_GIB = 0.5
GPUS_GIB = {"H200": 140.4, "MI300X": 192.0, "MI355X": 288.0}  # capacity as the runtime reports it


@dataclass(frozen=True)
class Term:
    """Bytes one layer saves for its backward: ``per_token`` x tokens + ``per_sequence`` x sequences (the
    micro-batch) + ``per_position`` x sequence positions + ``fixed``. ``piece``: the ``--recompute-modules`` name
    that drops it (None: kept); ``only_with``: a name whose recomputation makes the layer keep it."""

    what: str
    per_token: float = 0.0
    per_sequence: float = 0.0
    per_position: float = 0.0
    fixed: float = 0.0
    piece: str | None = None
    only_with: str | None = None


def layer_terms(cfg, path: str = "kernels", routed_share: float = 1.0) -> list[Term]:
    """The tensors one ZAYA1 layer (of this TP rank) saves, for ``path`` "kernels" (GPU) or "torch" (eager).

    Widths: D hidden, Q = query heads x head dim, K = KV heads x head dim (the value width too), F expert FFN,
    R router width, C router classes, h / hk query / KV heads (per TP rank), rot the RoPE dims, e the parameter
    dtype's bytes. ``routed_share``: the share of tokens that reach an expert (the eager experts keep
    activations for routed tokens only; the kernels' static buffer keeps all tokens).
    """
    tp = cfg.tensor_model_parallel_size
    d, D, F, R = cfg.kv_channels, cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.router_hidden_size
    h, hk = cfg.num_attention_heads // tp, cfg.num_query_groups // tp
    Q, K, C = h * d, hk * d, cfg.num_router_classes
    rot, e = int(d * cfg.rotary_percent), _dtype_bytes(cfg)
    t0, t1 = cfg.cca_time0, cfg.cca_time1
    if path == "kernels":
        return [
            Term("layer input (fp32 residual) + norm statistics", 4 * D + 4),
            Term("input norm output", 2 * D, piece="layernorm"),
            Term("CCA q0, k0", 2 * (Q + K)),
            Term("CCA convolution outputs", 2 * (Q + K), piece="cca_qk"),
            Term("RoPE cos, sin", per_position=8 * rot, piece="cca_qk"),
            Term("q, k (cca_qk's outputs: the cast to bf16 is a no-op)", 2 * (Q + K), piece="cca_qk"),
            Term("v", 2 * K),
            Term("attention output + logsumexp", 2 * Q + 4 * h, piece="core_attn"),
            Term("attention projection output", 2 * D),
            Term("pre-MoE norm statistics", 4, piece="layernorm"),
            Term("residual after attention (fp32)", 4 * D),
            Term("pre-MoE norm output", 2 * D, piece="layernorm"),
            Term("router MLP (fp32) and logits", 24 * R + 4 * C + 8, fixed=4 * (2 * R * R + R * C + R), piece="router"),
            Term("router state (the next layer's EDA input)", 4 * R),
            Term("dispatch permutations", 16, piece="moe"),
            Term("experts: permuted tokens, fc1 output, probs, SwiGLU output", 2 * D + 4 * F + 4 + 2 * F,
                 piece="moe"),
            Term("MoE output", 2 * D),
        ]
    pad = (t0 - 1) + (t1 - 1)
    return [
        Term("layer input (fp32 residual)", 4 * D),
        Term("input norm: statistics, cast, output", 4 + 2 * e * D, piece="layernorm"),
        Term("CCA convolutions", 8 * (Q + K), per_sequence=4 * (Q + K) * (pad + t1 - 1),
             fixed=4 * (Q + K) * (t0 + d * t1), piece="cca_qk"),
        Term("CCA QK-norm and temperature", 4 * Q + 8 * K + 12 * (h + hk), piece="cca_qk"),
        Term("RoPE cos, sin", per_position=16 * rot, piece="cca_qk"),
        Term("CCA q0, k0, inputs of the recomputed convolutions and epilogue", e * (Q + K), only_with="cca_qk"),
        # in fp32 attention saves cca_qk's outputs themselves (the cast to the parameter dtype is a no-op)
        Term("q, k", e * (Q + K), piece="cca_qk" if e == 4 else None),
        Term("v", e * K),
        Term("attention output + logsumexp", e * Q + 4 * h, piece="core_attn"),
        Term("attention merge (fp32)", 8 * D, piece="layernorm"),
        Term("attention projection output, input of the recomputed merge", e * D, only_with="layernorm"),
        Term("pre-MoE norm: residual, statistics, cast", 4 * D + 4 + e * D, piece="layernorm"),
        Term("pre-MoE norm output", e * D, piece="layernorm"),
        Term("router input (fp32 copy)", 4 * D if e != 4 else 0, piece="router"),
        Term("router MLP (fp32), probabilities, choice, routing map", 24 * R + 4 + 4 * C + 8 + cfg.num_moe_experts + 1,
             piece="router"),
        Term("router state (the next layer's EDA input)", 4 * R),
        Term("dispatch permutations", 16, piece="moe"),
        Term("experts: permuted tokens and probabilities", e * D + 4, piece="moe"),
        Term("experts: fc1, SwiGLU and fc2 inputs (routed tokens)", 6 * e * F * routed_share, piece="moe"),
        Term("MoE merge (fp32)", 8 * D),
    ]


def _dtype_bytes(cfg) -> int:
    import torch

    return torch.tensor([], dtype=cfg.params_dtype).element_size()


def layer_bytes(cfg, tokens: int, sequences: int, recompute: tuple[str, ...] = (), path: str = "kernels",
                routed_share: float = 1.0) -> float:
    """Bytes one layer keeps for the backward: ``tokens`` on this rank in ``sequences`` sequences (the
    micro-batch); ``recompute``: the ``--recompute-modules`` pieces."""
    dropped = set(recompute) | ({"router"} if "moe" in recompute else set())
    total = 0.0
    for term in layer_terms(cfg, path, routed_share):
        if term.piece in dropped or (term.only_with is not None and term.only_with not in recompute):
            continue
        positions = tokens // sequences
        total += term.per_token * tokens + term.per_sequence * sequences + term.per_position * positions + term.fixed
    return total


def stack_bytes(cfg, layers: int, tokens: int, sequences: int, recompute: tuple[str, ...] = (),
                path: str = "kernels", routed_shares: list[float] | None = None) -> float:
    """Bytes ``layers`` consecutive layers keep: :func:`layer_bytes` each, less the last layer's router state
    when the router is recomputed (only the next layer's recomputation keeps a layer's state)."""
    shares = routed_shares or [1.0] * layers
    total = sum(layer_bytes(cfg, tokens, sequences, recompute, path, share) for share in shares)
    if {"router", "moe"} & set(recompute):
        total -= 4 * cfg.router_hidden_size * tokens
    return total


# ---- parameters ------------------------------------------------------------------------------------------
@dataclass
class Parallel:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    dp: int = 1
    expert_dp: int = 1


def parameter_counts(cfg, par: Parallel, stage: int = 0) -> dict[str, float]:
    """Parameters on one rank of pipeline ``stage``, by optimizer (Muon matrices, AdamW) and by data-parallel
    group ("dense" reduced over DP, "expert" over the expert-data-parallel group)."""
    tp, D, d, R = par.tp, cfg.hidden_size, cfg.kv_channels, cfg.router_hidden_size
    Q, K = cfg.num_attention_heads * d, cfg.num_query_groups * d
    C, F, E, V = cfg.num_router_classes, cfg.moe_ffn_hidden_size, cfg.num_moe_experts, cfg.vocab_size
    layers = cfg.num_layers / par.pp
    conv = (Q + K) * (cfg.cca_time0 + 1 + d * cfg.cca_time1 + 1) + cfg.num_query_groups
    vectors = 2 * D + (8 * D if cfg.residual_scaling else 0) + 4 * R + (R if cfg.router_eda else 0)
    per_layer = {
        "muon dense": (D * Q + 2 * D * K + Q * D) / tp + D * R + 2 * R * R + R * C,
        "adamw dense": conv / tp + vectors,
        "muon expert": 3 * D * F * E / (par.ep * par.etp),
    }
    counts = {name: n * layers for name, n in per_layer.items()}
    first, last = stage == 0, stage == par.pp - 1
    embedding = V * D / tp
    counts["adamw dense"] += embedding * (first + (last and (par.pp > 1 or not cfg.tie_embeddings)))
    counts["adamw dense"] += (2 * D if first and cfg.residual_scaling else 0) + (D if last else 0)
    return counts


# ---- the plan ----------------------------------------------------------------------------------------------
@dataclass
class Run:
    """What the plan needs from the command line (``training.arguments.memory_plan_inputs``)."""

    micro_batch: int
    seq: int
    global_batch: int
    optimizer: str = "zaya_muon"
    bf16: bool = True
    distributed_optimizer: bool = False
    grad_bf16: bool = False
    bf16_momentum: bool = False
    recompute: str | None = None  # None | "full" | "selective"
    recompute_method: str = "uniform"  # with "full": --recompute-method and --recompute-num-layers
    recompute_num_layers: int = 1
    recompute_modules: tuple[str, ...] = ()
    cuda_graphs: bool = False
    sequence_parallel: bool = False
    lm_head_grad_in_forward: bool = True
    path: str = "kernels"
    async_save: bool = False
    memory_ckpt_keep: int = 0  # --zaya-memory-ckpt-keep with --zaya-memory-ckpt-interval; 0: no in-memory tier
    gpus_per_node: int = 1


def plan(cfg, par: Parallel, run: Run, stage: int = 0) -> dict[str, float]:
    """Bytes per GPU by component (pipeline ``stage``; stage 0 holds the most micro-batches in flight)."""
    counts = parameter_counts(cfg, par, stage)
    params = sum(counts.values())
    shard = {"dense": par.dp, "expert": par.expert_dp} if run.distributed_optimizer else {"dense": 1, "expert": 1}
    weight = STATE_BYTES["weight"] if run.bf16 else 4
    grad = 2 if run.grad_bf16 else STATE_BYTES["grad"]
    master = STATE_BYTES["muon_master"] if run.bf16 else 0
    momentum = 2 if run.bf16_momentum else STATE_BYTES["muon_momentum"]
    adam = STATE_BYTES["adamw_state"] - (0 if run.bf16 else 4)
    muon = run.optimizer == "zaya_muon"
    out = {"weights": weight * params, "gradients": grad * params, "master weights": 0.0, "optimizer state": 0.0}
    for name, n in counts.items():
        kind, group = name.split()
        if kind == "muon" and muon:
            out["master weights"] += master * n / shard[group]
            out["optimizer state"] += momentum * n / shard[group]
        else:
            out["master weights"] += (adam - 8) * n / shard[group]
            out["optimizer state"] += 8 * n / shard[group]

    tokens = run.micro_batch * run.seq // par.cp // (par.tp if run.sequence_parallel else 1)
    layers = math.ceil(cfg.num_layers / par.pp)
    if run.recompute == "full":  # a recomputed run keeps its input; one run's activations live during its backward
        from .model.recompute import full_recompute_segments  # imports torch: only where a plan is made

        segments = full_recompute_segments(layers, run.recompute_method, run.recompute_num_layers)
        recomputed = [len(indices) for indices, again in segments if again]
        kept = layers - sum(recomputed)
        stream, router_state = 4 * cfg.hidden_size * tokens, 4 * cfg.router_hidden_size * tokens
        first_run = bool(recomputed) and stage == 0  # it holds the model's first layer, which takes no router state
        # Each layer's terms hold its output router state, which the next layer keeps: so does the first layer kept
        # after a recomputed one (block).
        handed_on = bool(recomputed) and kept > 0
        activations = ((stream + router_state) * len(recomputed) + (handed_on - first_run) * router_state
                       + stack_bytes(cfg, kept, tokens, run.micro_batch, (), run.path)
                       + max(recomputed, default=0) * layer_bytes(cfg, tokens, run.micro_batch, (), run.path))
    else:
        modules = run.recompute_modules if run.recompute == "selective" else ()
        activations = stack_bytes(cfg, layers, tokens, run.micro_batch, modules, run.path)
    in_flight = min(par.pp - stage, max(1, run.global_batch // (run.micro_batch * par.dp))) if par.pp > 1 else 1
    D, V = cfg.hidden_size, cfg.vocab_size / par.tp
    edge = (stage == 0) * (2 + 4) * D * tokens + (stage == par.pp - 1) * (4 + 2 + 4 + 16) * D * tokens
    out["activations per micro-batch"] = activations + edge
    out["activations in flight"] = (in_flight - 1) * out["activations per micro-batch"]
    last = stage == par.pp - 1
    from .kernels.cross_entropy import WEIGHT_GRAD_CHUNKS, forward_token_chunk  # imports triton: only here

    chunk = min(forward_token_chunk(int(V)), tokens)
    held = 4 * V * D if run.lm_head_grad_in_forward else 0  # the fp32 weight gradient, forward to backward
    # A chunk's fp32 logits, and the bf16 gradients of the chunks that share a weight-gradient GEMM; the weight's
    # gradient goes into main_grad in place.
    out["LM-head chunks"] = last * ((4 * chunk + 2 * min(WEIGHT_GRAD_CHUNKS * chunk, tokens)) * V + held)
    graphs = run.cuda_graphs
    out["CUDA graphs"] = graphs * (last * GRAPH_RESERVE_BYTES_PER_HEAD_ELEMENT * V * D
                                   + 2 * 4 * (D + cfg.router_hidden_size) * tokens)
    if run.distributed_optimizer and muon:
        from .optim.muon import NS_BATCH_NUMEL  # imports torch: only where a plan is made

        adamw_shard = sum(n / shard[name.split()[1]] for name, n in counts.items() if not name.startswith("muon"))
        out["optimizer-step transient"] = (run.grad_bf16 * ZERO1_ADAMW_GRAD_BYTES * adamw_shard
                                           + ZERO1_MUON_BATCH_BYTES_PER_ELEMENT * NS_BATCH_NUMEL)
    else:
        out["optimizer-step transient"] = STEP_TRANSIENT_BYTES.get(run.optimizer, 0.0) * params
    out["checkpoint writer"] = run.async_save * ASYNC_WRITER_GIB * GIB
    state = (out["weights"] + out["gradients"] + out["master weights"] + out["optimizer state"] + out["CUDA graphs"]
             + out["checkpoint writer"])
    backward = state + out["activations per micro-batch"] + out["activations in flight"] + out["LM-head chunks"]
    out["between steps"] = state + (graphs * out["activations per micro-batch"])
    out["peak"] = max(backward, state + out["optimizer-step transient"])
    return out


def _node_checkpoint_state(result: dict[str, float], run: Run, world_size: int) -> float:
    """The checkpoint state of a node's GPUs: weights, master weights and optimizer state (an upper bound: a rank
    saves only the tensors it writes, and a fully parallel save spreads the replicated ones)."""
    state = result["weights"] + result["master weights"] + result["optimizer state"]
    return state * min(run.gpus_per_node, world_size)


def checkpoint_part_bytes(cfg, par: Parallel, run: Run, stage: int = 0, fully_parallel: bool = True) -> float:
    """Bytes of one rank's part of a save on pipeline ``stage``, what its staging pool holds (checkpoint/staging.py,
    allocated at start-up from this): its weights, master weights and optimizer state. A fully parallel save
    (Megatron's default, and the local tier's ``fully_parallel``) writes each tensor replicated over a
    data-parallel group from one of its ranks, so every byte of the state, sharded by a distributed optimizer or
    replicated, is spread over the group: evenly here (Megatron assigns whole tensors, so a rank's part can be a
    little larger). Without it the group's first rank writes every replicated tensor, the bound used for every
    rank."""
    spread = {"dense": par.dp, "expert": par.expert_dp} if fully_parallel else {"dense": 1, "expert": 1}
    result = plan(cfg, par, dataclasses.replace(run, distributed_optimizer=run.distributed_optimizer or fully_parallel),
                  stage)
    weight = STATE_BYTES["weight"] if run.bf16 else 4
    weights = sum(weight * n / spread[name.split()[1]] for name, n in parameter_counts(cfg, par, stage).items())
    return weights + result["master weights"] + result["optimizer state"]


def background_save_host_bytes(result: dict[str, float], run: Run, world_size: int) -> float:
    """Host memory per node that ``--async-save`` pins for its staging pool (checkpoint/staging.py): the node's
    checkpoint state."""
    return run.async_save * _node_checkpoint_state(result, run, world_size)


def memory_tier_host_bytes(result: dict[str, float], run: Run, world_size: int) -> float:
    """Host memory per node that the in-memory tier takes (``--zaya-memory-ckpt-interval``): the node's checkpoint
    state for the K parts kept and the one being written, twice when the node also keeps the copies of another
    node's parts, and once more for the pool that a save is staged in (checkpoint/staging.py)."""
    copies = 2 if world_size > run.gpus_per_node else 1
    return _node_checkpoint_state(result, run, world_size) * ((run.memory_ckpt_keep + 1) * copies + 1)


def largest_micro_batch(cfg, par: Parallel, run: Run, capacity_gib: float) -> int:
    """The largest micro-batch (up to 1024) whose peak fits ``capacity_gib`` minus ``RESERVE_GIB``; 0: none."""
    fits = 0
    for mbs in range(1, 1025):
        if plan(cfg, par, dataclasses.replace(run, micro_batch=mbs))["peak"] > (capacity_gib - RESERVE_GIB) * GIB:
            break
        fits = mbs
    return fits


def report(cfg, par: Parallel, run: Run) -> str:
    """The plan as text: one line per component, the peak, and the largest micro-batch per GPU type."""
    result = plan(cfg, par, run)
    params = sum(parameter_counts(cfg, par).values())
    lines = [f"[zaya] memory plan per GPU (pipeline stage 0): TP{par.tp} PP{par.pp} EP{par.ep} CP{par.cp} "
             f"DP{par.dp}, {params / 1e9:.3f}B parameters on this rank, micro-batch {run.micro_batch} x seq "
             f"{run.seq}, {run.optimizer}{' distributed' if run.distributed_optimizer else ''}, "
             f"recompute {run.recompute or 'none'} {' '.join(run.recompute_modules)}".rstrip()]
    for name, value in result.items():
        if name == "peak":
            lines.append("  " + "-" * 44)
        lines.append(f"  {name:<28s} {value / GIB:9.2f} GiB")
    for gpu, gib in GPUS_GIB.items():
        lines.append(f"  largest micro-batch on {gpu:<7s} ({gib:.0f} GiB): {largest_micro_batch(cfg, par, run, gib)}")
    world = par.tp * par.pp * par.cp * par.dp
    if run.async_save:
        lines.append(f"  background saves, pinned host memory per node: "
                     f"{background_save_host_bytes(result, run, world) / GIB:.2f} GiB ({min(run.gpus_per_node, world)} "
                     "GPUs' staging pools; no device copy)")
    if run.memory_ckpt_keep:
        lines.append(f"  in-memory checkpoints, host memory per node: "
                     f"{memory_tier_host_bytes(result, run, world) / GIB:.2f} GiB ({min(run.gpus_per_node, world)} "
                     f"GPUs, {run.memory_ckpt_keep} kept + 1 being written"
                     f"{', the copies of another node' if world > run.gpus_per_node else ''} and the staging "
                     "pool)")
    return "\n".join(lines)

