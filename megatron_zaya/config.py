"""ZAYA1 configuration: Megatron's ``TransformerConfig`` plus the fields ZAYA1 adds, and named presets.

Every ZAYA1 sublayer pair is ``x += CCA(norm(x)); x += MoE(norm(x))`` with learned residual scaling, so the
Megatron defaults that ZAYA1 fixes (RMSNorm, SwiGLU experts, no linear biases, top-1 routing, no dropout,
an fp32 residual stream) are re-declared here with ZAYA1's values. Section numbers refer to
``docs/architecture.md``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from .dataclass_flags import megatron_field, setting
from .errors import ZayaConfigError

ATTENTION_TYPES = ("global", "sliding")
SKIP_MODES = ("zero", "identity")
CORE_ATTENTIONS = ("sdpa", "te")  # CCA's softmax attention: torch's SDPA, or Transformer Engine's fused attention
# The model's ops that have a Triton kernel (megatron_zaya/kernels) beside their torch reference (megatron_zaya/ops),
# and the sublayer ops, each one autograd op over some of those kernels (SUBLAYER_OPS: the kernel ops it composes):
# ``moe``, the MoE sublayer (ops/moe.py), and ``cca_sublayer``, the CCA sublayer up to its attention
# (ops/cca_sublayer.py).
KERNEL_OPS = ("router", "router_head", "residual", "cca", "lm_head", "experts", "moe", "cca_sublayer")
SUBLAYER_OPS = {"moe": ("router", "router_head", "experts"), "cca_sublayer": ("residual", "cca")}
# ``--recompute-granularity selective --recompute-modules ...``: what each name recomputes in every ZAYA1 layer
# (model/recompute.py). The default set is the cheap one: elementwise work and the small router MLP.
RECOMPUTE_MODULES = {
    "layernorm": "the input and pre-MoE RMSNorms (with the merge before the second); their outputs are dropped",
    "cca_qk": "CCA's convolutions and epilogue (skip terms, QK-norm, key temperature, RoPE)",
    "router": "the router MLP (EDA, RMSNorm, GELU MLP, top-1)",
    "core_attn": "the softmax attention; its output is dropped (one more attention forward in the backward)",
    "moe": "the whole MoE sublayer (router, dispatch, experts: one more MoE forward in the backward)",
}
DEFAULT_RECOMPUTE_MODULES = ("layernorm", "cca_qk", "router")


def kernel_selection(kernels: str) -> tuple[str, ...]:
    """The ops a ``ZayaConfig.kernels`` value names ("all" and "none" name none); unknown names are an error."""
    if kernels in ("all", "none"):
        return ()
    ops = tuple(op.strip() for op in kernels.split(",") if op.strip())
    unknown = sorted(set(ops) - set(KERNEL_OPS))
    if unknown or not ops:
        raise ZayaConfigError(f"unknown kernel ops {unknown} in {kernels!r}; use all, none or a comma-separated "
                              f"list of {','.join(KERNEL_OPS)}")
    return ops


@dataclass
class ZayaConfig(TransformerConfig):
    """Megatron ``TransformerConfig`` with ZAYA1's fields (docs/architecture.md §1–§4)."""

    # -- model-level shape (not in TransformerConfig) --------------------------------------------------
    vocab_size: int = setting(262_272, flag="--zaya-vocab-size", type=int, cli_default=None,
                              help="model vocabulary (embedding rows); default: the tokenizer's, padded")
    max_position_embeddings: int = 131_072
    tie_embeddings: bool = True
    lm_head_fp32: bool = setting(True, flag="--zaya-lm-head-precision", choices={"fp32": True, "param": False},
                                 help="fp32: logits from an fp32 matmul (ZAYA1's high-precision head, §1)")
    lm_head_grad_in_forward: bool = setting(
        True, flag="--zaya-lm-head-backward", choices={"in-forward": True, "recompute": False},
        help="fused LM head: compute its gradients in the forward (3 GEMMs, an fp32 [V, D] gradient held until the "
             "backward) or recompute the logits in the backward (4 GEMMs, less memory)")

    # -- CCA (§3) ---------------------------------------------------------------------------------------
    cca_time0: int = setting(2, flag="--zaya-cca-time0", help="CCA depthwise (per-channel) causal conv taps")
    cca_time1: int = setting(2, flag="--zaya-cca-time1", help="CCA per-head grouped causal conv taps")
    key_temperature_init: float = setting(1.0, flag="--zaya-key-temperature-init",
                                          help="init of the learned per-KV-head key scale; 0 would zero the keys")
    # RoPE on the first half of each head's channels, after QK-norm
    rotary_percent: float = megatron_field(0.5, "--rotary-percent")
    rotary_base: float = 5_000_000.0  # θ of global-attention layers
    sliding_window: int | None = setting(None, flag="--zaya-sliding-window", type=int,
                                         help="tokens a sliding layer attends to, itself included")
    sliding_rotary_base: float = setting(10_000.0, flag="--zaya-sliding-rotary-base",
                                         help="RoPE θ of sliding-window layers")
    attention_types: list[str] | None = setting(
        None, flag="--zaya-attention-types", type=str, cli_default=None,
        help="comma-separated global|sliding per layer, or a shorter pattern repeated over the layers "
             "(default: all global)")

    # -- router and MoE (§4) ----------------------------------------------------------------------------
    router_hidden_size: int = setting(256, flag="--zaya-router-hidden-size", help="router MLP width R")
    router_eda: bool = setting(True, flag="--zaya-no-router-eda",
                               help="disable exponential depth averaging of the router state across MoE layers")
    skip_class: bool = setting(True, flag="--zaya-no-skip-class",
                               help="no extra 'skip' router class (a class with no expert compute)")
    skip_mode: Literal["zero", "identity"] = setting(
        "zero", flag="--zaya-skip-mode", choices={mode: mode for mode in SKIP_MODES},
        help="a skipped token outputs 0 (ZAYA1-8B) or p_skip*x (ZAYA1-base)")
    skip_bias_init: float = setting(-1.0, flag="--zaya-skip-bias-init", help="initial balancing bias of the skip class")
    balancing_lr: float = setting(1e-3, flag="--zaya-balancing-lr",
                                  help="Adam lr of the balancing biases (on observed share - 1/E, once per step)")
    balancing_betas: tuple[float, float] = setting((0.9, 0.999), flag="--zaya-balancing-betas", type=float, nargs=2,
                                                   help="Adam betas of the balancing biases")
    balancing_eps: float = setting(1e-8, flag="--zaya-balancing-eps", help="Adam eps of the balancing biases")
    balancing_warmup_steps: int = setting(
        0, flag="--zaya-balancing-warmup-steps",
        help="ramp the balancing biases' step size linearly from 0 to --zaya-balancing-lr over this many steps "
             "(ZAYA1's warm-up of the balancing gain); 0: the full step size from the first step")
    balance_skip_class: bool = setting(False, flag="--zaya-balance-skip-class", help="also balance the skip class")

    # -- residual path (§2) -----------------------------------------------------------------------------
    residual_scaling: bool = setting(True, flag="--zaya-no-residual-scaling",
                                     help="plain residual adds instead of (x + β) ⊙ α + (h + β') ⊙ α' per sublayer")

    # -- execution --------------------------------------------------------------------------------------
    cuda_graphs: bool = setting(
        False, flag="--zaya-cuda-graphs",
        help="replay each layer's training forward and backward as CUDA graphs (one GPU per expert set: EP = TP = PP "
             "= CP = 1); removes the host's kernel-launch time from the step (model/cuda_graphs.py)")
    core_attention: Literal["sdpa", "te"] = setting(
        "sdpa", flag="--zaya-core-attention", choices={name: name for name in CORE_ATTENTIONS},
        help="CCA's softmax attention: sdpa (torch's scaled_dot_product_attention) or te (Transformer Engine's "
             "fused attention, global layers only)")
    kernels: str = setting("all", flag="--zaya-kernels",
                           help="the model's ops that run as Triton kernels: all (on a GPU; none on CPU) | none | a "
                                "comma-separated list of " + ",".join(KERNEL_OPS))
    # Selective recomputation, run by ZAYA1's layer itself: ``__post_init__`` moves ``recompute_modules`` here and
    # leaves Megatron's field empty, so that Megatron's own layer and MoE code recompute nothing.
    zaya_recompute_modules: tuple[str, ...] = ()

    # -- Megatron fields with ZAYA1's values (megatron_field: zaya-pretrain's Megatron flags come from these) ----
    normalization: str = megatron_field("RMSNorm", "--normalization")
    layernorm_epsilon: float = megatron_field(1e-5, "--norm-epsilon")
    gated_linear_unit: bool = megatron_field(True, "--swiglu")
    activation_func: object = F.silu  # SwiGLU with gated_linear_unit (Megatron's --swiglu sets both)
    add_bias_linear: bool = megatron_field(False, "--disable-bias-linear")
    hidden_dropout: float = megatron_field(0.0, "--hidden-dropout")
    attention_dropout: float = megatron_field(0.0, "--attention-dropout")
    # The residual stream is fp32 (residual_in_fp32). Not Megatron's --fp32-residual-connection flag: Megatron
    # refuses it without --bf16/--fp16, and with fp32 parameters the setting changes nothing.
    fp32_residual_connection: bool = megatron_field(True)
    moe_router_topk: int = megatron_field(1, "--moe-router-topk")
    # Megatron requires it for top-1; our router does its own softmax.
    moe_router_pre_softmax: bool = megatron_field(True, "--moe-router-pre-softmax")
    moe_router_load_balancing_type: str = megatron_field("none", "--moe-router-load-balancing-type")
    moe_aux_loss_coeff: float = megatron_field(0.0, "--moe-aux-loss-coeff")
    moe_token_dispatcher_type: str = megatron_field("alltoall", "--moe-token-dispatcher-type")
    bias_dropout_fusion: bool = megatron_field(False)
    apply_rope_fusion: bool = megatron_field(False, "--no-rope-fusion")
    masked_softmax_fusion: bool = megatron_field(False)
    gradient_accumulation_fusion: bool = False  # zaya-pretrain turns it on where the fused kernel is present

    def __post_init__(self):
        self.validate_zaya()
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.attention_types is None:
            self.attention_types = ["global"] * self.num_layers
        if self.recompute_granularity == "selective":
            if self.recompute_modules or not self.zaya_recompute_modules:  # (not on a copy of a built config)
                self.zaya_recompute_modules = tuple(self.recompute_modules or DEFAULT_RECOMPUTE_MODULES)
            self.recompute_modules = []
        super().__post_init__()

    def validate_zaya(self) -> None:
        """One-line errors for combinations ZAYA1 cannot express (checked before Megatron's own checks)."""
        heads, groups = self.num_attention_heads, self.num_query_groups or self.num_attention_heads
        head_dim = self.kv_channels or self.hidden_size // heads

        def fail(problem: str, fix: str) -> None:
            raise ZayaConfigError(f"{problem}; {fix}")

        if heads % groups:
            fail(f"num_attention_heads={heads} is not divisible by num_query_groups={groups}",
                 "choose KV heads that divide the query heads")
        rotary_dim = int(head_dim * self.rotary_percent)
        if rotary_dim % 2 or rotary_dim <= 0:
            fail(f"rotary dim = kv_channels*rotary_percent = {head_dim}*{self.rotary_percent} = {rotary_dim} "
                 "is not a positive even number", "pick rotary_percent so that it is even")
        if (groups * head_dim) % 2:
            fail(f"value width num_query_groups*kv_channels = {groups * head_dim} is odd",
                 "the value time-delay splits it in half; use an even kv_channels")
        if self.cca_time0 < 1 or self.cca_time1 < 1:
            fail(f"cca_time0={self.cca_time0}, cca_time1={self.cca_time1}", "both conv sizes must be >= 1")
        if self.router_hidden_size < 1:
            fail(f"--zaya-router-hidden-size {self.router_hidden_size}", "the router MLP needs a width of at least 1")
        for flag, value in (("--zaya-balancing-lr", self.balancing_lr), ("--zaya-balancing-eps", self.balancing_eps)):
            if value < 0:
                fail(f"{flag} {value:g} is negative", "the balancing biases' Adam takes 0 or more")
        if not all(0 <= beta < 1 for beta in self.balancing_betas):
            fail(f"--zaya-balancing-betas {' '.join(f'{b:g}' for b in self.balancing_betas)}",
                 "Adam's betas must be at least 0 and below 1")
        if self.balancing_warmup_steps < 0:
            fail(f"--zaya-balancing-warmup-steps {self.balancing_warmup_steps} is negative",
                 "give a number of steps >= 0 (0: no warm-up)")
        if not self.num_moe_experts:
            fail("num_moe_experts is not set", "every ZAYA1 layer is an MoE layer: set --num-experts")
        if self.moe_router_topk != 1:
            fail(f"moe_router_topk={self.moe_router_topk}", "ZAYA1 routes top-1: set --moe-router-topk 1")
        if self.skip_mode not in SKIP_MODES:
            fail(f"skip_mode={self.skip_mode!r} is unknown", f"use one of {SKIP_MODES}")
        if self.attention_types is not None:
            if len(self.attention_types) != self.num_layers:
                fail(f"attention_types has {len(self.attention_types)} entries for {self.num_layers} layers",
                     "give one type per layer")
            unknown = set(self.attention_types) - set(ATTENTION_TYPES)
            if unknown:
                fail(f"unknown attention types {sorted(unknown)}", f"use {ATTENTION_TYPES}")
            if "sliding" in self.attention_types and not (self.sliding_window and self.sliding_window > 0):
                fail(f"sliding layers are configured with sliding_window={self.sliding_window}",
                     "set --zaya-sliding-window to 1 or more")
        fewest = 1 if self.recompute_method == "uniform" else 0
        if self.recompute_granularity == "full" and self.recompute_num_layers is not None \
                and self.recompute_num_layers < fewest:
            fail(f"--recompute-num-layers {self.recompute_num_layers} with --recompute-method {self.recompute_method}",
                 "give the layers per recomputed run (uniform, 1 or more) or the layers recomputed (block, 0 or more)")
        if self.cuda_graphs and self.recompute_granularity == "full":
            fail("--zaya-cuda-graphs with full recomputation (the graphs capture whole layers, forward and backward)",
                 "use --recompute-granularity selective, or drop --zaya-cuda-graphs")
        if self.cuda_graphs and (self.hidden_dropout or self.attention_dropout):
            fail("--zaya-cuda-graphs with dropout (replays would reuse the captured random offsets)",
                 "set --hidden-dropout 0 --attention-dropout 0 or drop --zaya-cuda-graphs")
        named = kernel_selection(self.kernels)
        for op, pieces in SUBLAYER_OPS.items():
            if op in named and not set(pieces) <= set(named):
                fail(f"the {op} kernel op composes the {', '.join(pieces[:-1])} and {pieces[-1]} kernels",
                     f"name them too: --zaya-kernels {','.join(dict.fromkeys((*named, *pieces)))}")
        if self.core_attention not in CORE_ATTENTIONS:
            fail(f"core_attention={self.core_attention!r} is unknown", f"use one of {CORE_ATTENTIONS}")
        if self.core_attention == "te" and "sliding" in (self.attention_types or ()):
            fail("Transformer Engine's attention does not handle ZAYA1's sliding layers here",
                 "use --zaya-core-attention sdpa")
        if self.recompute_granularity == "selective" and self.recompute_modules:
            unknown = [name for name in self.recompute_modules if name not in RECOMPUTE_MODULES]
            if unknown:
                fail(f"--recompute-modules {' '.join(unknown)} is not a ZAYA1 piece",
                     f"choose from {' '.join(RECOMPUTE_MODULES)}")

    def uses_kernel(self, op: str) -> bool:
        """Whether the model runs ``op`` (one of ``KERNEL_OPS``) as its Triton kernel rather than its torch reference.

        Read by the ``choose`` functions of ``megatron_zaya/ops`` when a module is built. ``all`` takes every kernel
        on a GPU (CUDA or ROCm) and the references on a CPU, where they are faster; a named op takes its kernel on
        any device (off a GPU its ``fused_*`` function computes the reference, or runs the kernel in Triton's
        interpreter under ``TRITON_INTERPRET=1``). Under CUDA graphs too: the fused router head and the sublayer
        ops cut the layer's device time as well as its launches (docs/benchmarks.md, "One layer's launches").
        """
        if op not in KERNEL_OPS:
            raise ValueError(f"unknown kernel op {op!r}; one of {KERNEL_OPS}")
        if self.kernels == "all":
            return torch.cuda.is_available()
        return op in kernel_selection(self.kernels)

    @property
    def num_router_classes(self) -> int:
        return self.num_moe_experts + int(self.skip_class)


# Named presets: ZayaConfig keyword arguments. The CLI turns them into Megatron flags, explicit flags win.
# The ZAYA1 width (§1): 2048 hidden, CCA with 8 query / 2 KV heads of 128, 16 experts of 2048, router 256.
_ZAYA1_WIDTH = dict(
    hidden_size=2048, num_attention_heads=8, num_query_groups=2, kv_channels=128, ffn_hidden_size=2048,
    num_moe_experts=16, router_hidden_size=256, vocab_size=262_272,
)
PRESETS: dict[str, dict] = {
    # The released ZAYA1-8B shape (8.3B total / 760M active), 131k context, θ 5e6.
    "zaya1-8b": dict(_ZAYA1_WIDTH, num_layers=40, max_position_embeddings=131_072, rotary_base=5_000_000.0),
    # ZAYA1-base as released after 32k midtraining: θ 1e6, 32k positions, skipped tokens pass as p·x.
    "zaya1-base": dict(_ZAYA1_WIDTH, num_layers=40, max_position_embeddings=32_768, rotary_base=1_000_000.0,
                       skip_mode="identity"),
    # ZAYA1-8B width at 8 layers: the single-GPU benchmark and example model.
    "zaya1-8b-shallow": dict(_ZAYA1_WIDTH, num_layers=8, max_position_embeddings=4096, rotary_base=10_000.0),
    # CPU demo: trains on the embedded corpus in minutes on two cores.
    "tiny": dict(
        num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2, kv_channels=32,
        ffn_hidden_size=256, num_moe_experts=4, router_hidden_size=64, vocab_size=4096,
        max_position_embeddings=1024, rotary_base=10_000.0,
    ),
    # Unit tests: the smallest shape that still has GQA, several experts and two layers of EDA.
    "test": dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        ffn_hidden_size=96, num_moe_experts=4, router_hidden_size=32, vocab_size=512,
        max_position_embeddings=256, rotary_base=10_000.0,
    ),
}


# The fields that define a model's architecture (what a checkpoint must agree on); the rest is runtime.
ARCHITECTURE_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
    "moe_ffn_hidden_size", "num_moe_experts", "vocab_size", "max_position_embeddings", "tie_embeddings",
    "layernorm_epsilon", "cca_time0", "cca_time1", "rotary_percent", "rotary_base", "sliding_window",
    "sliding_rotary_base", "attention_types", "router_hidden_size", "router_eda", "skip_class", "skip_mode",
    "residual_scaling",
)


def architecture(cfg: ZayaConfig) -> dict:
    """The architecture fields of ``cfg`` as plain Python values (stored in checkpoints)."""
    return {name: getattr(cfg, name) for name in ARCHITECTURE_FIELDS}


def preset(name: str) -> dict:
    """The keyword arguments of a named preset (a copy)."""
    if name not in PRESETS:
        raise ZayaConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return dict(PRESETS[name])


def zaya_config(name: str | None = None, **overrides) -> ZayaConfig:
    """Build a :class:`ZayaConfig` from a preset and explicit overrides (overrides win)."""
    kwargs = preset(name) if name else {}
    kwargs.update(overrides)
    unknown = set(kwargs) - {f.name for f in dataclasses.fields(ZayaConfig)}
    if unknown:
        raise ZayaConfigError(f"unknown ZayaConfig fields {sorted(unknown)}; check the spelling")
    return ZayaConfig(**kwargs)


__all__ = ["ZayaConfig", "ZayaConfigError", "KERNEL_OPS", "PRESETS", "RECOMPUTE_MODULES", "DEFAULT_RECOMPUTE_MODULES",
           "ARCHITECTURE_FIELDS", "architecture", "preset", "zaya_config"]
