"""Every Triton kernel at ZAYA1-8B shapes in bf16 on a GPU (CUDA or ROCm), against float64 torch.

Skipped without a GPU. Each test checks the kernel is at least as close to a float64 evaluation of the
torch reference as the reference itself run in bf16 (``assert_matches_oracle``), forward and backward.
Run: ``python -m pytest -q tests/gpu/test_kernels_gpu.py`` (well under a minute of GPU time; tens of GB of memory).
"""

import functools

import pytest
import torch

import cca_kernel_arguments
from triton_interpreter import assert_matches_oracle

import megatron_zaya.ops.router  # noqa: F401  (ops.router: the head's reference, read through ops below)
from megatron_zaya import ops
from megatron_zaya.kernels import cca, cross_entropy, grouped_gemm, residual_rmsnorm, router, sort_by_expert, swiglu
from megatron_zaya.ops import grouped_mm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")

SEQ, BATCH, HIDDEN, FFN, EXPERTS, VOCAB = 4096, 2, 2048, 2048, 16, 262272
TOKENS = SEQ * BATCH
N_Q, N_KV, HEAD_DIM, ROT = 8, 2, 128, 64
BF16 = torch.bfloat16


def _randn(*shape, scale=1.0, dtype=BF16, gen):
    return (scale * torch.randn(*shape, generator=gen, device="cuda")).to(dtype)


def _run(fn, tensors, grads, *args, dtype=None, **kwargs):
    """outputs and d(inputs) of ``fn(*tensors, *args)``; tensors cast to ``dtype`` (the float64 oracle)."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]
    outputs = fn(*leaves, *args, **kwargs)
    outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
    differentiable = [o for o in outputs if o.requires_grad]
    in_grads = torch.autograd.grad(differentiable, leaves, [g.to(o.dtype) for o, g in zip(differentiable, grads)])
    return [o.detach() for o in outputs] + list(in_grads)


def _compare(names, kernel_fn, reference_fn, tensors, grads, *args, **kwargs):
    kernel = _run(kernel_fn, tensors, grads, *args, **kwargs)
    reference = _run(reference_fn, tensors, grads, *args, **kwargs)
    oracle = _run(reference_fn, tensors, grads, *args, dtype=torch.float64, **kwargs)
    for name, k, r, o in zip(names, kernel, reference, oracle):
        assert k.dtype == r.dtype, f"{name}: {k.dtype} != {r.dtype}"
        assert_matches_oracle(name, k, o, r)


def test_rms_norm():
    gen = torch.Generator("cuda").manual_seed(0)
    x, weight = _randn(TOKENS, HIDDEN, gen=gen), 1 + _randn(HIDDEN, scale=0.2, gen=gen)
    _compare(["out", "d_x", "d_weight"], residual_rmsnorm.rms_norm, ops.residual_norm.rms_norm,
             [x, weight], [_randn(TOKENS, HIDDEN, gen=gen)], 1e-5)  # fmt: skip


def test_residual_rms_norm():
    gen = torch.Generator("cuda").manual_seed(1)
    tensors = [_randn(SEQ, BATCH, HIDDEN, gen=gen), _randn(SEQ, BATCH, HIDDEN, scale=4, dtype=torch.float32, gen=gen),
               _randn(HIDDEN, scale=0.1, gen=gen), 1 + _randn(HIDDEN, scale=0.2, gen=gen),
               _randn(HIDDEN, scale=0.1, gen=gen), 1 + _randn(HIDDEN, scale=0.2, gen=gen),
               1 + _randn(HIDDEN, scale=0.2, gen=gen)]  # fmt: skip
    grads = [_randn(SEQ, BATCH, HIDDEN, gen=gen), _randn(SEQ, BATCH, HIDDEN, dtype=torch.float32, gen=gen)]
    names = ["normed", "new_residual", "d_hidden", "d_residual", "d_hidden_bias", "d_hidden_scale",
             "d_residual_bias", "d_residual_scale", "d_weight"]  # fmt: skip
    _compare(names, residual_rmsnorm.residual_rms_norm, ops.residual_norm.residual_rms_norm,
             tensors, grads, 1e-5)  # fmt: skip


@pytest.mark.parametrize("weighted", [False, True])
def test_swiglu(weighted):
    gen = torch.Generator("cuda").manual_seed(2)
    tensors = [_randn(TOKENS, 2 * FFN, scale=2, gen=gen)]
    if weighted:
        tensors.append(torch.rand(TOKENS, 1, generator=gen, device="cuda"))
    _compare(["out", "d_x", "d_weights"], swiglu.swiglu, ops.experts.swiglu, tensors,
             [_randn(TOKENS, FFN, gen=gen)])  # fmt: skip


def test_router_projection():
    gen = torch.Generator("cuda").manual_seed(8)
    x, weight, bias = _randn(TOKENS, HIDDEN, gen=gen), _randn(256, HIDDEN, scale=0.02, gen=gen), _randn(256, gen=gen)
    grad = torch.randn(TOKENS, 256, device="cuda", generator=gen)
    _compare(["out", "d_x", "d_weight", "d_bias"], router.router_projection, ops.router.router_projection,
             [x, weight, bias], [grad])


def test_residual_norm_and_merge():
    gen = torch.Generator("cuda").manual_seed(9)
    residual = _randn(TOKENS, HIDDEN, scale=4, dtype=torch.float32, gen=gen)
    weight = 1 + _randn(HIDDEN, scale=0.3, gen=gen)
    grad = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen)
    _compare(["out", "d_residual", "d_weight"], residual_rmsnorm.residual_norm,
             ops.residual_norm.residual_norm, [residual, weight], [grad], 1e-5)
    hidden = _randn(TOKENS, HIDDEN, gen=gen)
    vectors = [_randn(HIDDEN, scale=0.1, gen=gen), 1 + _randn(HIDDEN, scale=0.3, dtype=torch.float32, gen=gen),
               _randn(HIDDEN, scale=0.1, gen=gen), 1 + _randn(HIDDEN, scale=0.3, gen=gen)]
    _compare(["new_residual", "d_hidden", "d_residual", "d_hidden_bias", "d_hidden_scale", "d_residual_bias",
              "d_residual_scale"], residual_rmsnorm.residual_merge, ops.residual_norm.residual_merge,
             [hidden, residual, *vectors], [grad])


def test_route_top1():
    """Forward and backward against float64. Every random input comes from the test's own generator, so the
    test sees the same numbers whatever ran before it in the process; tokens whose top-1 wins by less than 1e-6
    in float64 may choose differently (at most 0.1% of them) and are left out of the comparison."""
    gen = torch.Generator("cuda").manual_seed(3)
    logits = _randn(TOKENS, EXPERTS + 1, scale=2, dtype=torch.float32, gen=gen)
    biases = _randn(EXPERTS + 1, scale=0.1, dtype=torch.float32, gen=gen)
    grads = [torch.randn(TOKENS, EXPERTS, device="cuda", generator=gen),  # probs
             torch.randn(TOKENS, device="cuda", generator=gen)]  # skip_gate
    top2 = (logits.double().softmax(-1) + biases.double()).topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 1e-6
    assert clear.float().mean() > 0.999
    grads = [grads[0] * clear[:, None], grads[1] * clear]

    def outputs_and_grads(fn, dtype=None):
        leaf = logits.to(dtype or logits.dtype).requires_grad_()
        probs, routing_map, skip_gate, counts = fn(leaf, biases, EXPERTS)
        (d_logits,) = torch.autograd.grad([probs, skip_gate], leaf, [g.to(probs.dtype) for g in grads])
        return probs[clear].detach(), routing_map[clear], skip_gate[clear].detach(), counts, d_logits

    kernel = outputs_and_grads(router.route_top1)
    reference = outputs_and_grads(ops.router.route_top1)
    oracle = outputs_and_grads(ops.router.route_top1, dtype=torch.float64)
    assert torch.equal(kernel[1], oracle[1]) and int(kernel[3].sum()) == TOKENS
    for i, name in ((0, "probs"), (2, "skip_gate"), (4, "d_logits")):
        assert kernel[i].dtype == reference[i].dtype, f"{name}: {kernel[i].dtype} != {reference[i].dtype}"
        assert_matches_oracle(name, kernel[i], oracle[i], reference[i])


@pytest.mark.parametrize("precision", ["tf32x3", "ieee"])  # the CUDA row's choice and its fallback
def test_route_head(precision, monkeypatch):
    """The fused router head at ZAYA1-8B's router (R = 256, 16 experts + skip) with bf16 parameters. Tokens whose
    top-1 wins by less than 1e-4 (float64) may choose differently: they get no gate gradient and are left out of
    the routing comparison; at most 1% of them."""
    if torch.version.hip and precision != "ieee":
        pytest.skip("ROCm runs the fp32 dots in ieee")
    monkeypatch.setitem(router.ROUTER_HEAD_TUNING["rocm" if torch.version.hip else "cuda"], "precision", precision)
    gen = torch.Generator("cuda").manual_seed(10)
    width, classes = 256, EXPERTS + 1
    tensors = [_randn(TOKENS, width, scale=2, dtype=torch.float32, gen=gen),  # u
               _randn(TOKENS, width, dtype=torch.float32, gen=gen),  # state_in
               1 + _randn(width, scale=0.3, gen=gen), 1 + _randn(width, scale=0.2, gen=gen),  # eda_scale, norm_weight
               _randn(width, width, scale=2 / width**0.5, gen=gen), _randn(width, scale=0.3, gen=gen),
               _randn(width, width, scale=2 / width**0.5, gen=gen), _randn(width, scale=0.3, gen=gen),
               _randn(classes, width, scale=3 / width**0.5, gen=gen)]  # fmt: skip
    biases = _randn(classes, scale=0.05, dtype=torch.float32, gen=gen)
    logits = []

    def capture(scores, *args):
        logits.append(scores.detach())
        return ops.router.route_top1(scores, *args)

    args = [t.double() for t in tensors] + [biases, 1e-5, EXPERTS]
    ops.router.route_head(*args, route_top1=capture)
    top2 = (logits[0].softmax(-1) + biases).topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 1e-4
    assert clear.float().mean() > 0.99
    grads = [torch.randn(TOKENS, EXPERTS, device="cuda", generator=gen) * clear[:, None],  # probs
             torch.randn(TOKENS, width, device="cuda", generator=gen),  # state
             torch.randn(TOKENS, device="cuda", generator=gen) * clear]  # skip_gate  # fmt: skip

    def outputs_and_grads(fn, dtype=None):
        probs, routing_map, state, skip_gate, counts, *in_grads = _run(fn, tensors, grads, biases, 1e-5, EXPERTS,
                                                                       dtype=dtype)  # fmt: skip
        return [probs[clear], routing_map[clear], state, skip_gate[clear], counts, *in_grads]

    kernel = outputs_and_grads(router.route_head)
    reference = outputs_and_grads(ops.router.route_head)
    oracle = outputs_and_grads(ops.router.route_head, dtype=torch.float64)
    assert torch.equal(kernel[1], oracle[1]) and int(kernel[4].sum()) == TOKENS
    names = ["probs", "map", "state", "skip_gate", "counts", "d_u", "d_state_in", "d_eda_scale", "d_norm_weight",
             "d_fc1_weight", "d_fc1_bias", "d_fc2_weight", "d_fc2_bias", "d_out_weight"]  # fmt: skip
    for name, k, r, o in zip(names, kernel, reference, oracle, strict=True):
        if name not in ("map", "counts"):
            assert k.dtype == r.dtype, f"{name}: {k.dtype} != {r.dtype}"
            assert_matches_oracle(name, k, o, r)


@pytest.mark.parametrize("target_dtype", [torch.float32, BF16])
def test_add_into_is_torchs_addition(target_dtype):
    """The fused head's gradients into ``main_grad`` (``router.add_into``): bit for bit ``Tensor.add_`` of each
    fp32 source into its target, in one launch; the head's shapes at ZAYA1-8B's router width."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    sizes = [256, 256, 256, 256, 256, 256 * 256, 256 * 256, 17 * 256]
    targets = [_randn(n, scale=10.0, dtype=target_dtype, gen=gen) for n in sizes]
    sources = [_randn(n, dtype=torch.float32, gen=gen) for n in sizes]
    expected = [t.clone().add_(s) for t, s in zip(targets, sources)]
    router.add_into(targets, sources)
    for got, want in zip(targets, expected):
        assert torch.equal(got, want)


def test_cross_entropy():
    gen = torch.Generator("cuda").manual_seed(4)
    tokens = 2048
    logits = _randn(tokens, VOCAB, scale=3, gen=gen)
    labels = torch.randint(0, VOCAB, (tokens,), generator=gen, device="cuda")
    _compare(["loss", "d_logits"], cross_entropy.cross_entropy, ops.lm_head.cross_entropy, [logits],
             [torch.rand(tokens, generator=gen, device="cuda")], labels)  # fmt: skip


@pytest.mark.parametrize("grad_kind", ["one_factor", "per_token"])  # d weight from the forward; recomputed
def test_linear_cross_entropy(grad_kind):  # (a per-token gradient gets a NaN d weight from the forward)
    gen = torch.Generator("cuda").manual_seed(5)
    tokens = 2048
    hidden, weight = _randn(tokens, HIDDEN, gen=gen), _randn(VOCAB, HIDDEN, scale=0.02, gen=gen)
    labels = torch.randint(0, VOCAB, (tokens,), generator=gen, device="cuda")
    labels[::13] = cross_entropy.IGNORE_INDEX
    grad = (torch.rand(tokens, generator=gen, device="cuda") if grad_kind == "per_token"
            else torch.full((tokens,), 1 / tokens, device="cuda"))
    four_token_chunks = functools.partial(cross_entropy.linear_cross_entropy, token_chunk=512,
                                          grad_in_forward=grad_kind == "one_factor")
    _compare(["loss", "d_hidden", "d_weight"], four_token_chunks, ops.lm_head.linear_cross_entropy,
             [hidden, weight], [grad], labels)  # fmt: skip


def test_the_heads_temporaries_come_from_its_own_pool():
    """The fused head's forward with gradients takes its fp32 [V, D] weight gradient and its chunk buffers from a
    pool of its own, and a second step reserves nothing new there or in the general cache."""
    gen = torch.Generator("cuda").manual_seed(5)
    tokens = 2048
    hidden = _randn(tokens, HIDDEN, gen=gen).requires_grad_()
    weight = _randn(VOCAB, HIDDEN, scale=0.02, gen=gen).requires_grad_()
    labels = torch.randint(0, VOCAB, (tokens,), generator=gen, device="cuda")

    def step():
        cross_entropy.linear_cross_entropy(hidden, weight, labels, token_chunk=512).mean().backward()
        torch.cuda.synchronize()

    step()
    pool = cross_entropy._POOLS[torch.cuda.current_device()]
    pooled = sum(segment["total_size"] for segment in pool.snapshot())
    assert pooled >= 4 * VOCAB * HIDDEN + (4 + 2) * 512 * VOCAB  # the weight gradient and a chunk's buffers
    reserved = torch.cuda.memory_reserved()
    step()
    assert sum(segment["total_size"] for segment in pool.snapshot()) == pooled
    assert torch.cuda.memory_reserved() == reserved


def test_cca_qk():
    gen = torch.Generator("cuda").manual_seed(6)
    q_ch, k_ch = N_Q * HEAD_DIM, N_KV * HEAD_DIM
    tensors = [_randn(SEQ, BATCH, q_ch, gen=gen), _randn(SEQ, BATCH, k_ch, gen=gen),
               _randn(q_ch, 2, scale=0.5, gen=gen), _randn(q_ch, scale=0.1, gen=gen),
               _randn(k_ch, 2, scale=0.5, gen=gen), _randn(k_ch, scale=0.1, gen=gen),
               _randn(q_ch, HEAD_DIM, 2, scale=0.05, gen=gen), _randn(q_ch, scale=0.1, gen=gen),
               _randn(k_ch, HEAD_DIM, 2, scale=0.05, gen=gen), _randn(k_ch, scale=0.1, gen=gen),
               1 + _randn(N_KV, scale=0.3, gen=gen)]  # fmt: skip
    angles = torch.outer(torch.arange(SEQ, device="cuda", dtype=torch.float32),
                         1e4 ** (-torch.arange(0, ROT, 2, device="cuda") / ROT))  # fmt: skip
    angles = torch.cat([angles, angles], dim=-1)
    grads = [_randn(SEQ, BATCH, N_Q, HEAD_DIM, gen=gen), _randn(SEQ, BATCH, N_KV, HEAD_DIM, gen=gen)]
    names = ["q", "k", "d_q0", "d_k0", "d_wq1", "d_bq1", "d_wk1", "d_bk1", "d_wq2", "d_bq2", "d_wk2", "d_bk2",
             "d_temp"]  # fmt: skip
    # the model's reference computes in fp32 and rounds q and k once, to the attention's dtype
    _compare(names, cca_kernel_arguments.kernel(cca), cca_kernel_arguments.reference, tensors, grads, angles[:, None])


@pytest.mark.parametrize("chunks", [1, 2])
def test_cca_convolutions(chunks):
    """The convolution kernels at ZAYA1-8B's q width, bf16; ``chunks=2``: context parallelism's two chunks per
    rank, each read after its own history (whose gradient is checked too)."""
    gen = torch.Generator("cuda").manual_seed(9)
    q_ch = N_Q * HEAD_DIM
    tensors = [_randn(SEQ, BATCH, q_ch, gen=gen), _randn(q_ch, 2, scale=0.5, gen=gen), _randn(q_ch, scale=0.1, gen=gen),
               _randn(q_ch, HEAD_DIM, 2, scale=0.05, gen=gen), _randn(q_ch, scale=0.1, gen=gen)]  # fmt: skip
    if chunks > 1:
        tensors.append(_randn(chunks, 2, BATCH, q_ch, gen=gen))

    def bind(fn):
        return lambda x, w1, b1, w2, b2, *history: fn(x, w1, b1, w2, b2, N_Q, *history)

    names = ["out", "d_x", "d_w1", "d_b1", "d_w2", "d_b2", "d_history"]
    _compare(names, bind(cca.causal_qk_convs_fused), bind(ops.cca.causal_convs), tensors,
             [_randn(SEQ, BATCH, q_ch, gen=gen)])  # fmt: skip


def test_grouped_gemm():
    gen = torch.Generator("cuda").manual_seed(7)
    counts = torch.multinomial(torch.ones(EXPERTS, device="cuda"), TOKENS, replacement=True, generator=gen)
    counts = torch.bincount(counts, minlength=EXPERTS)
    counts[1] += counts[0]
    counts[0] = 0  # an idle expert
    x, weight = _randn(TOKENS, HIDDEN, gen=gen), _randn(EXPERTS, 2 * FFN, HIDDEN, scale=0.02, gen=gen)
    _compare(["out", "d_x", "d_weight"], grouped_gemm.grouped_gemm, ops.experts.grouped_gemm,
             [x, weight], [_randn(TOKENS, 2 * FFN, gen=gen)], counts.cpu())  # fmt: skip


def test_grouped_gemm_separate_expert_weights():
    """The experts' own [M, K] weights read by address (what ``kernels.zaya_experts`` passes), with a tail of
    rows that belong to no expert (the skip class in the single-rank dispatch)."""
    gen = torch.Generator("cuda").manual_seed(8)
    routed = TOKENS - 700
    counts = torch.bincount(torch.multinomial(torch.ones(EXPERTS, device="cuda"), routed, replacement=True,
                                              generator=gen), minlength=EXPERTS)  # fmt: skip
    x = _randn(TOKENS, HIDDEN, gen=gen)
    weights = [_randn(2 * FFN, HIDDEN, scale=0.02, gen=gen) for _ in range(EXPERTS)]

    def kernel(x, *weights_and_counts):
        *weights, counts = weights_and_counts
        return grouped_gemm.grouped_gemm(x, weights, counts, padded_rows=True)

    def reference(x, *weights_and_counts):
        *weights, counts = weights_and_counts
        return ops.experts.grouped_gemm(x, torch.stack(weights), counts, padded_rows=True)

    names = ["out", "d_x", *(f"d_weight[{e}]" for e in range(EXPERTS))]
    _compare(names, kernel, reference, [x, *weights], [_randn(TOKENS, 2 * FFN, gen=gen)], counts.cpu())
    out = kernel(x, *weights, counts)
    assert (out[routed:] == 0).all()  # written by the spare tiles: the output is not zero-filled first


@pytest.mark.skipif(not grouped_mm.available("cuda", BF16), reason="this torch has no torch._grouped_mm here")
@pytest.mark.parametrize("order", [1, -1], ids=["at-one-stride", "reversed-as-in-megatron-buffers"])
@pytest.mark.parametrize("backends", [grouped_mm.Backends("torch", "torch", "torch"),
                                      grouped_mm.Backends("torch", "torch", "triton")], ids=["torch", "wgrad-triton"])
def test_grouped_gemm_on_torch_grouped_mm(backends, order):
    """The grouped GEMM with its GEMMs on ``torch._grouped_mm`` (ops/grouped_mm.py) against the Triton kernel, at
    fc1's shape: the experts' weights in one buffer (read in place, or a stacked copy when in reverse order), an
    idle expert and a tail of rows of no expert. As close to float64 as the Triton kernel, and the tail zero."""
    gen = torch.Generator("cuda").manual_seed(9)
    routed = TOKENS - 700
    counts = torch.bincount(torch.multinomial(torch.ones(EXPERTS, device="cuda"), routed, replacement=True,
                                              generator=gen), minlength=EXPERTS)  # fmt: skip
    counts[1] += counts[0]
    counts[0] = 0
    weights = _randn(EXPERTS, 2 * FFN, HIDDEN, scale=0.02, gen=gen).unbind(0)[::order]
    assert (grouped_mm.stacked(weights).data_ptr() == weights[0].data_ptr()) == (order == 1)
    tensors, grads = [_randn(TOKENS, HIDDEN, gen=gen), *weights], [_randn(TOKENS, 2 * FFN, gen=gen)]

    def on(chosen):
        def run(x, *weights_and_counts):
            *weights, counts = weights_and_counts
            if chosen is None:
                return ops.experts.grouped_gemm(x, torch.stack(weights), counts, padded_rows=True)
            return ops.experts.fused_grouped_gemm(x, weights, counts, padded_rows=True, backends=chosen)
        return run

    on_torch = _run(on(backends), tensors, grads, counts)
    on_triton = _run(on(grouped_mm.TRITON), tensors, grads, counts)
    oracle = _run(on(None), tensors, grads, counts, dtype=torch.float64)
    for name, got, triton, want in zip(["out", "d_x", *(f"d_weight[{e}]" for e in range(EXPERTS))], on_torch,
                                       on_triton, oracle):  # fmt: skip
        assert_matches_oracle(name, got, want, triton)
    assert (on_torch[0][routed:] == 0).all() and (on_torch[1][routed:] == 0).all()


@pytest.mark.parametrize("first,num_experts", [(0, EXPERTS), (4, 4)], ids=["all-experts", "four-of-an-ep-rank"])
def test_sort_by_expert(first, num_experts):
    """ZAYA1-8B's 16 experts + the skip class at 16,384 tokens (one in 17 to the skip class): the same order, inverse and
    counts as the torch reference's stable sort."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    chosen = torch.randint(0, EXPERTS + 1, (2 * TOKENS,), generator=gen, device="cuda")
    routing_map = torch.nn.functional.one_hot(chosen, EXPERTS + 1).bool()
    routing_map[:, EXPERTS] = False  # the skip class routes to no expert
    for got, want in zip(sort_by_expert.sort_by_expert(routing_map, first, num_experts),
                         ops.experts.sort_by_expert(routing_map, first, num_experts)):
        assert torch.equal(got, want)
