"""The ``cpu`` patch group: stock Megatron-Core GPT/MoE model code on a CPU with gloo.

One process: a small GPTModel (local spec, RMSNorm, RoPE, SwiGLU, GQA) and its MoE variant
(SequentialMLP experts, alltoall dispatcher) run forward and backward; the loss and every gradient
match a float64 plain-torch transcription of the same network. Two gloo processes: TP2 (dense) and EP2
(MoE) reproduce the one-process loss. Also the RNG tracker and gradient clipping against plain torch.
"""

import math
import tempfile
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

VOCAB, SEQ, BATCH = 64, 8, 2
SEED = 1234


def apply_cpu_patches():
    from megatron_zaya.patches import apply_patches

    apply_patches("startup,cpu")


def gpt_config(moe: bool, cpu_init: bool, **parallel):
    from megatron.core.transformer import TransformerConfig

    moe_fields = dict(
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=[0, 1],
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
    )  # fmt: skip
    return TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=cpu_init,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        **(moe_fields if moe else {}), **parallel,
    )  # fmt: skip


def build_gpt(config):
    """A stock Megatron GPTModel on local (no-TE) specs; the MoE variant has SequentialMLP experts."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    if config.num_moe_experts:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")


def seed_everything():
    from megatron.core import tensor_parallel

    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)


def batch():
    """Token ids and next-token labels ``[b, s]``."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def megatron_token_losses(model):
    """Megatron's per-token loss ``[b, s]`` of the batch."""
    tokens, labels = batch()
    return model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None, labels=labels)


def global_name(name: str, ep_rank: int, experts_per_rank: int) -> str:
    """The parameter name with the local expert index (``local_experts.{i}``) made global."""
    if ".local_experts." not in name:
        return name
    head, tail = name.split(".local_experts.")
    local, rest = tail.split(".", 1)
    return f"{head}.local_experts.{ep_rank * experts_per_rank + int(local)}.{rest}"


def fill_by_name(model, ep_rank: int = 0, experts_per_rank: int = 4):
    """Set every parameter from its *global* name, so an EP-sharded model equals the unsharded one."""
    for name, param in model.named_parameters():
        name = global_name(name, ep_rank, experts_per_rank)
        generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        values = torch.randn(param.shape, generator=generator)
        param.data.copy_(1 + 0.1 * values if name.endswith("layernorm.weight") else 0.05 * values)


# --- float64 reference: the same network written out in plain torch ------------------------------


def rms_norm(x, weight, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def swiglu_mlp(x, p, prefix):
    gate, up = (x @ p[prefix + "linear_fc1.weight"].T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ p[prefix + "linear_fc2.weight"].T


def top2_moe(x, p, prefix, num_experts=4):
    """Softmax over the top-2 router logits weights the two chosen SwiGLU experts; x ``[t, h]``."""
    top_logits, top_experts = (x @ p[prefix + "router.weight"].T).topk(2, dim=-1)
    weights = top_logits.softmax(dim=-1)
    out = torch.zeros_like(x)
    for expert in range(num_experts):
        rows, slot = (top_experts == expert).nonzero(as_tuple=True)
        expert_out = swiglu_mlp(x[rows], p, f"{prefix}experts.local_experts.{expert}.")
        out = out.index_add(0, rows, weights[rows, slot, None] * expert_out)
    return out


def rotate(x, angles):
    """RoPE on ``x [b, s, heads, d]``: halves rotated by ``angles [s, d]`` (non-interleaved)."""
    first, second = x.chunk(2, dim=-1)
    angles = angles[None, :, None, :]
    return x * angles.cos() + torch.cat([-second, first], dim=-1) * angles.sin()


def reference_token_losses(p, tokens, labels, heads=4, groups=2):
    """Per-token cross-entropy ``[b, s]`` of the GPT in ``p`` (Megatron parameter names -> float64)."""
    b, s = tokens.shape
    x = p["embedding.word_embeddings.weight"][tokens]  # [b, s, h]
    d = x.shape[-1] // heads
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(s, dtype=torch.float64), inv_freq).repeat(1, 2)  # [s, d]
    future = torch.ones(s, s, dtype=torch.bool).triu(1)
    for i in range(2):
        layer = f"decoder.layers.{i}."
        qkv = rms_norm(x, p[layer + "input_layernorm.weight"]) @ p[layer + "self_attention.linear_qkv.weight"].T
        qkv = qkv.view(b, s, groups, heads // groups + 2, d)  # per group: its query heads, one key, one value
        q = rotate(qkv[:, :, :, :-2].reshape(b, s, heads, d), angles)
        k = rotate(qkv[:, :, :, -2].repeat_interleave(heads // groups, dim=2), angles)
        v = qkv[:, :, :, -1].repeat_interleave(heads // groups, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        context = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, heads * d)
        x = x + context @ p[layer + "self_attention.linear_proj.weight"].T
        h = rms_norm(x, p[layer + "pre_mlp_layernorm.weight"])
        if layer + "mlp.router.weight" in p:
            x = x + top2_moe(h.reshape(b * s, -1), p, layer + "mlp.").view_as(h)
        else:
            x = x + swiglu_mlp(h, p, layer + "mlp.")
    logits = rms_norm(x, p["decoder.final_layernorm.weight"]) @ p["output_layer.weight"].T
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(b, s)


# --- one process -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def single_rank():
    """gloo world of one and Megatron's parallel state (all sizes 1), with the cpu patches applied."""
    from megatron.core import parallel_state

    apply_cpu_patches()
    if not dist.is_initialized():
        # a rendezvous file, not MASTER_PORT: the CLI runs of later tests in this process would inherit the variable
        # and find the port held by this process group
        store = Path(tempfile.mkdtemp(prefix="zaya-gloo-")) / "rendezvous"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_gpt_forward_backward_match_float64_reference(single_rank, moe):
    seed_everything()  # the weights are drawn on the "GPU" path: through the RNG tracker's fork
    model = build_gpt(gpt_config(moe, cpu_init=False))
    losses = megatron_token_losses(model)
    losses.mean().backward()

    params = {name: param.detach().double().requires_grad_() for name, param in model.named_parameters()}
    assert any("local_experts.3" in name for name in params) == moe
    expected = reference_token_losses(params, *batch())
    expected.mean().backward()

    torch.testing.assert_close(losses.double(), expected.detach(), rtol=1e-5, atol=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad.double(), params[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_rng_tracker_forks_its_own_stream_and_restores(single_rank):
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    torch.manual_seed(7)
    outside_stream = torch.rand(6)

    torch.manual_seed(7)
    first = torch.rand(3)
    with tracker.fork():  # the tensor-model-parallel stream: seed + 2718 + tp_rank
        inside = torch.rand(4)
    rest = torch.rand(3)

    torch.testing.assert_close(inside, torch.rand(4, generator=torch.Generator().manual_seed(SEED + 2718)))
    torch.testing.assert_close(torch.cat([first, rest]), outside_stream)  # the fork left the default stream alone

    saved = tracker.get_states()  # what a checkpoint stores
    with tracker.fork():
        drawn = torch.rand(5)
    tracker.set_states(saved)
    with tracker.fork():
        torch.testing.assert_close(torch.rand(5), drawn)


def test_clip_grads_scales_cpu_gradients(single_rank):
    from megatron.core.optimizer import clip_grads

    grads = [torch.randn(5, 3, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    params = [torch.nn.Parameter(torch.zeros(5, 3)) for _ in grads]
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    total_norm = torch.cat([g.flatten() for g in grads]).norm().item()

    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=total_norm)

    for param, grad in zip(params, grads):
        torch.testing.assert_close(param.grad, grad * (1.0 / (total_norm + 1e-6)))
    assert torch.zeros(1).type() == "torch.FloatTensor"  # the type-name hook ended with the call


def test_megatron_fusions_run_eagerly_and_match_float64(single_rank):
    """``cpu.eager_fusions``: no compiled wrapper is left in Megatron's fusion modules, and the weighted
    bias-SwiGLU (what ZAYA1's experts call) gives float64 torch's values and gradients."""
    from megatron.core.fusions import fused_bias_dropout, fused_bias_swiglu

    for module in (fused_bias_swiglu, fused_bias_dropout):
        compiled = [n for n, v in vars(module).items() if getattr(v, "_torchdynamo_orig_callable", None)]
        assert compiled == [], (module.__name__, compiled)
    torch.manual_seed(SEED)
    x, weights = torch.randn(6, 8, requires_grad=True), torch.rand(6, 1, requires_grad=True)
    out = fused_bias_swiglu.weighted_bias_swiglu_impl(x, None, weights)
    out.pow(2).sum().backward()
    x64, w64 = x.detach().double().requires_grad_(), weights.detach().double().requires_grad_()
    gate, up = x64.chunk(2, -1)
    reference = F.silu(gate) * up * w64
    reference.pow(2).sum().backward()
    torch.testing.assert_close(out.double(), reference, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weights.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)


def test_module_view_refuses_a_module_without_torch():
    from megatron_zaya.errors import PatchError
    from megatron_zaya.patches.cpu import _see_cpu_torch

    with pytest.raises(PatchError, match="json has no module-global `torch`"):
        _see_cpu_torch("json")


# --- two gloo processes ------------------------------------------------------------------------


def _parallel_worker(rank: int, world_size: int, out_dir: str) -> None:
    """On each rank: a TP2 dense GPT, then an EP2 MoE GPT; save the losses and expert gradients. The ranks meet
    through a file in the test's directory: a port picked free can be taken by a test running beside this one."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world_size)
    apply_cpu_patches()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    seed_everything()  # --use-cpu-initialization: each TP rank keeps its slice of the same full weights
    tp_loss = megatron_token_losses(build_gpt(gpt_config(moe=False, cpu_init=True, tensor_model_parallel_size=2)))
    parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    seed_everything()
    model = build_gpt(gpt_config(moe=True, cpu_init=True, expert_model_parallel_size=2))
    fill_by_name(model, ep_rank=rank, experts_per_rank=2)
    ep_loss = megatron_token_losses(model)
    ep_loss.mean().backward()  # both ranks feed the same batch: each expert sees every token twice
    expert_grads = {global_name(n, rank, 2): p.grad for n, p in model.named_parameters() if ".local_experts." in n}
    result = {"tp": tp_loss.detach(), "ep": ep_loss.detach(), "expert_grads": expert_grads}
    torch.save(result, f"{out_dir}/rank{rank}.pt")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_tp2_and_ep2_on_two_gloo_ranks_match_one_rank(single_rank, tmp_path):
    mp.spawn(_parallel_worker, args=(2, str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]

    seed_everything()
    dense = build_gpt(gpt_config(moe=False, cpu_init=True))
    one_rank_tp_loss = megatron_token_losses(dense).detach()
    seed_everything()
    moe = build_gpt(gpt_config(moe=True, cpu_init=True))
    fill_by_name(moe)
    one_rank_ep_loss = megatron_token_losses(moe)
    one_rank_ep_loss.mean().backward()

    for result in ranks:
        torch.testing.assert_close(result["tp"], one_rank_tp_loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(result["ep"], one_rank_ep_loss.detach(), rtol=1e-6, atol=1e-6)
    expert_grads = ranks[0]["expert_grads"] | ranks[1]["expert_grads"]
    one_rank_expert_grads = {n: p.grad for n, p in moe.named_parameters() if ".local_experts." in n}
    assert expert_grads.keys() == one_rank_expert_grads.keys()
    for name, grad in one_rank_expert_grads.items():
        torch.testing.assert_close(expert_grads[name], 2 * grad, rtol=1e-5, atol=1e-7, msg=name)
