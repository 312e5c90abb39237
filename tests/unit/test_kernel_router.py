"""ZAYA top-1 router epilogue Triton kernel (CPU interpreter) against float64 torch and transformers' ZayaRouter."""

import pytest
import torch

from triton_interpreter import assert_matches_oracle, load_kernel_module

from megatron_zaya.ops import router as ops

kernels = load_kernel_module("megatron_zaya.kernels.router")
EXPERTS = 5


def _inputs(tokens, logits_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(tokens, EXPERTS + 1, generator=gen)).to(logits_dtype)
    biases = 0.3 * torch.randn(EXPERTS + 1, generator=gen)
    biases[-1] = 0.1  # the skip class wins for some tokens
    return logits, biases


@pytest.mark.parametrize("launch_row", ["cpu", "cuda"])  # each platform's tokens per program, in the interpreter
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_route_top1_forward_backward(logits_dtype, launch_row, monkeypatch):
    monkeypatch.setitem(kernels.ROUTER_TUNING, "cpu", kernels.ROUTER_TUNING[launch_row])
    logits, biases = _inputs(77, logits_dtype)  # 77 tokens: several blocks, the last one partial
    grad_probs = torch.randn(77, EXPERTS)
    grad_skip = torch.randn(77)

    runs = {}
    for name, fn, cast in [("kernel", kernels.route_top1, None), ("reference", ops.route_top1, None),
                           ("oracle", ops.route_top1, torch.float64)]:  # fmt: skip
        leaf = logits.detach().to(cast or logits.dtype).requires_grad_()
        probs, routing_map, skip_gate, counts = fn(leaf, biases.to(cast or biases.dtype), EXPERTS)
        grads = [grad_probs.to(probs.dtype), grad_skip.to(probs.dtype)]
        (grad_logits,) = torch.autograd.grad([probs, skip_gate], [leaf], grads)
        runs[name] = probs, routing_map, skip_gate, counts, grad_logits

    kernel, reference, oracle = runs["kernel"], runs["reference"], runs["oracle"]
    assert torch.equal(kernel[1], oracle[1]) and kernel[1].dtype == torch.bool  # same choices as float64
    assert torch.equal(kernel[3], oracle[3]) and kernel[3].dtype == torch.int64
    assert 0 < kernel[3][-1] < 77 and kernel[1].sum() + kernel[3][-1] == 77  # some tokens skip; one class each
    assert kernel[0].dtype == kernel[2].dtype == torch.float32 and kernel[4].dtype == logits_dtype
    for i, name in [(0, "probs"), (2, "skip_gate"), (4, "d_logits")]:
        assert_matches_oracle(name, kernel[i], oracle[i], reference[i])


def test_reference_matches_transformers_zaya_router_selection():
    """Same expert, same unbiased gate as transformers' ZayaRouter (which zeroes the skip class)."""
    from transformers.models.zaya.configuration_zaya import ZayaConfig
    from transformers.models.zaya.modeling_zaya import ZayaRouter

    torch.manual_seed(0)
    config = ZayaConfig(hidden_size=32, router_hidden_size=16, num_experts=EXPERTS, num_hidden_layers=2)
    router = ZayaRouter(config, layer_idx=0)
    router.balancing_biases.copy_(_inputs(1, torch.float32, seed=1)[1])
    hidden = torch.randn(2, 9, 32)
    logits, hf_probs, hf_indices, _ = router(hidden)

    probs, routing_map, skip_gate, counts = ops.route_top1(logits, router.balancing_biases, EXPERTS)
    skipped = skip_gate > 0
    assert 0 < skipped.sum() < 18
    assert torch.equal(routing_map.int().argmax(-1)[~skipped], hf_indices[~skipped, 0])
    torch.testing.assert_close(probs.sum(-1), hf_probs[:, 0])  # HF gives the skip class weight 0
    assert counts.sum() == 18


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="num_experts \\+ 1"):
        kernels.route_top1(torch.randn(4, EXPERTS), torch.zeros(EXPERTS + 1), EXPERTS)
    with pytest.raises(ValueError, match="balancing biases"):
        kernels.route_top1(torch.randn(4, EXPERTS + 1), torch.zeros(EXPERTS), EXPERTS)


def test_router_projection_is_the_fp32_linear_of_bf16_inputs():
    """Forward: the fp32 products of bf16 values, i.e. the fp32 reference up to summation order. Backward: bf16
    GEMMs of the rounded output gradient, within bf16 rounding of float64."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 37, 64, generator=gen).to(torch.bfloat16)
    weight = (0.1 * torch.randn(24, 64, generator=gen)).to(torch.bfloat16)
    bias = (0.1 * torch.randn(24, generator=gen)).to(torch.bfloat16)
    grad = torch.randn(3, 37, 24, generator=gen)

    runs = {}
    for name, fn, cast in [("kernel", kernels.router_projection, None),
                           ("reference", ops.router_projection, None),
                           ("oracle", ops.router_projection, torch.float64)]:  # fmt: skip
        leaves = [t.detach().to(cast or t.dtype).requires_grad_() for t in (x, weight, bias)]
        out = fn(*leaves)
        runs[name] = (out, *torch.autograd.grad(out, leaves, grad.to(out.dtype)))
    kernel = runs["kernel"]
    assert kernel[0].dtype == torch.float32 and [g.dtype for g in kernel[1:]] == [torch.bfloat16] * 3
    torch.testing.assert_close(kernel[0], runs["oracle"][0].float(), rtol=1e-6, atol=1e-6)  # exact products
    for i, what in enumerate(["out", "d_x", "d_weight", "d_bias"]):
        assert_matches_oracle(what, kernel[i], runs["oracle"][i], runs["reference"][i])


def _head_inputs(tokens, width, param_dtype, with_state, seed=0):
    """u, state_in and the head's parameters, scaled so every layer's activations are O(1); the skip class wins for
    some tokens."""
    gen = torch.Generator().manual_seed(seed)
    classes = HEAD_EXPERTS + 1

    def param(*shape, scale=1.0, offset=0.0):
        return (offset + scale * torch.randn(*shape, generator=gen)).to(param_dtype)

    u = 2 * torch.randn(2, tokens // 2, width, generator=gen)
    state_in = torch.randn(2, tokens // 2, width, generator=gen) if with_state else None
    params = [param(width, scale=0.3, offset=1), param(width, scale=0.2, offset=1),  # eda_scale, norm_weight
              param(width, width, scale=2 / width**0.5), param(width, scale=0.3),  # fc1
              param(width, width, scale=2 / width**0.5), param(width, scale=0.3),  # fc2
              param(classes, width, scale=2 / width**0.5)]  # fmt: skip
    biases = 0.2 * torch.randn(classes, generator=gen)
    biases[-1] = 0.6
    return u, state_in, params, biases


HEAD_EXPERTS = 4


@pytest.mark.parametrize("width", [32, 64])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_state", [False, True], ids=["first-layer", "eda-state-and-its-gradient"])
def test_route_head_forward_backward(width, param_dtype, with_state):
    """The fused head against the reference head in float64: outputs, and the gradients of u, state_in and every
    parameter (eda_scale's is zero on the first MoE layer), from gradients on probs, skip_gate and the state."""
    tokens = 40  # three programs of 16 tokens, the last one partial
    u, state_in, params, biases = _head_inputs(tokens, width, param_dtype, with_state)
    gen = torch.Generator().manual_seed(1)
    grad_probs, grad_skip = torch.randn(tokens, HEAD_EXPERTS, generator=gen), torch.randn(tokens, generator=gen)
    grad_state = torch.randn(u.shape, generator=gen) if with_state else None  # the last MoE layer's state: unused

    runs = {}
    for name, fn, cast in [("kernel", kernels.route_head, None), ("reference", ops.route_head, None),
                           ("oracle", ops.route_head, torch.float64)]:  # fmt: skip
        leaves = [t.detach().to(cast or t.dtype).requires_grad_() for t in [u, *params]]
        state = None if state_in is None else state_in.to(cast or state_in.dtype).requires_grad_()
        if state is not None:
            leaves.insert(1, state)
        u_leaf, eda, norm, *weights = leaves[:1] + leaves[1 + with_state:]
        probs, routing_map, state_out, skip_gate, counts = fn(u_leaf, state, eda, norm, *weights,
                                                              biases.to(cast or biases.dtype), 1e-5, HEAD_EXPERTS)
        outputs, grads = [probs, skip_gate], [grad_probs, grad_skip]
        if grad_state is not None:
            outputs.append(state_out)
            grads.append(grad_state)
        runs[name] = [probs, routing_map, state_out, skip_gate, counts, *torch.autograd.grad(
            outputs, leaves, [g.to(o.dtype) for o, g in zip(outputs, grads)])]  # fmt: skip

    kernel, reference, oracle = runs["kernel"], runs["reference"], runs["oracle"]
    assert torch.equal(kernel[1], oracle[1]) and torch.equal(kernel[4], oracle[4])  # same choices as float64
    assert 0 < kernel[4][-1] < tokens and kernel[4].sum() == tokens  # some tokens skip
    assert [t.dtype for t in kernel[5:]] == [t.dtype for t in reference[5:]]  # params' grads in their dtype
    names = ["probs", "map", "state", "skip_gate", "counts", "d_u", *["d_state_in"] * with_state, "d_eda_scale",
             "d_norm_weight", "d_fc1_weight", "d_fc1_bias", "d_fc2_weight", "d_fc2_bias", "d_out_weight"]  # fmt: skip
    for name, k, r, o in zip(names, kernel, reference, oracle, strict=True):
        if name not in ("map", "counts"):
            assert_matches_oracle(name, k, o, r)


@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "router-recomputed"])
def test_fused_head_in_the_model_equals_the_reference(recompute):
    """The interpreted fused head in every router of the test model: its arguments, the EDA state passed from layer
    to layer (and its gradient back), selective recomputation around it: same loss and gradients."""
    from megatron_zaya.config import zaya_config
    from megatron_zaya.pretrained import build_single_process_model

    extra = dict(recompute_granularity="selective", recompute_modules=["router"]) if recompute else {}
    cfg = zaya_config("test", use_cpu_initialization=True, params_dtype=torch.float32,
                      moe_token_dispatcher_type="allgather", **extra)  # fmt: skip
    plain, fused = build_single_process_model(cfg), build_single_process_model(cfg)
    fused.load_state_dict(plain.state_dict())
    calls = []
    for layer in fused.decoder.layers:
        layer.mlp.router.route_head = lambda *args: calls.append(args[1] is not None) or kernels.route_head(*args)
    ids = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))

    def run(net):
        net.train().zero_grad(set_to_none=True)
        loss = net(ids, labels=ids)
        loss.sum().backward()
        return loss.detach(), {k: p.grad.clone() for k, p in net.named_parameters() if p.grad is not None}

    (ref_loss, ref_grads), (loss, grads) = run(plain), run(fused)
    forward = [False] + [True] * (len(fused.decoder.layers) - 1)  # the first MoE layer has no incoming state
    assert calls == forward + (forward[::-1] if recompute else [])  # the backward recomputes the last layer first
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(ref_grads) and any(".router.eda_scale" in key for key in grads)
    for key, grad in ref_grads.items():
        torch.testing.assert_close(grads[key], grad, rtol=1e-4, atol=1e-6, msg=key)


def _bias_in_head(x, down_weight, down_bias, state_in, *rest):
    """The projection without its bias, which the head adds (as the ``moe`` op calls them)."""
    u = kernels.router_projection(x, down_weight, None)
    return kernels.RouteHead.apply(*kernels.route_head_arguments(u, state_in, *rest, down_bias))


@pytest.mark.parametrize("bias_in_head", [False, True], ids=["bias-in-projection", "bias-in-head"])
def test_router_adds_parameter_gradients_into_main_grad(bias_in_head):
    """Under Megatron's DDP (bf16 parameters, each with an fp32 ``main_grad`` holding earlier micro-batches'
    gradients), the projection's and the head's backwards add the parameters' gradients into ``main_grad`` in fp32
    and mark the parameters, for DDP's hooks to add nothing; the projection's bias added by the head too."""
    _, state_in, params, biases = _head_inputs(40, 32, torch.bfloat16, with_state=True)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 20, 64, generator=gen).to(torch.bfloat16)
    down = [(0.1 * torch.randn(*shape, generator=gen)).to(torch.bfloat16) for shape in ((32, 64), (32,))]
    grad_probs, grad_skip = torch.randn(40, HEAD_EXPERTS, generator=gen), torch.randn(40, generator=gen)
    before = [torch.randn(p.shape, generator=gen) for p in (*down, *params)]

    def separate(projection, head):
        return lambda x, down_weight, down_bias, *rest: head(projection(x, down_weight, down_bias), *rest)

    def run(route, cast=None, main_grads=()):
        leaves = [t.detach().to(cast or t.dtype).requires_grad_() for t in (*down, *params)]
        for leaf, held in zip(leaves, main_grads):
            leaf.main_grad, leaf.grad_added_to_main_grad = held.clone(), False
        state = state_in.to(cast or state_in.dtype)
        probs, _, _, skip_gate, _ = route(x.to(cast or x.dtype), *leaves[:2], state, *leaves[2:],
                                          biases.to(cast or biases.dtype), 1e-5, HEAD_EXPERTS)
        return leaves, torch.autograd.grad([probs, skip_gate], leaves, [grad_probs.to(probs.dtype),
                                                                        grad_skip.to(probs.dtype)])

    kernel_route = _bias_in_head if bias_in_head else separate(kernels.router_projection, kernels.route_head)
    leaves, _ = run(kernel_route, main_grads=before)
    _, reference = run(separate(ops.router_projection, ops.route_head))
    _, oracle = run(separate(ops.router_projection, ops.route_head), torch.float64)
    names = ["down_weight", "down_bias", "eda_scale", "norm_weight", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias",
             "out_weight"]
    for name, leaf, held, r, o in zip(names, leaves, before, reference, oracle, strict=True):
        assert leaf.grad_added_to_main_grad, name
        assert_matches_oracle(name, leaf.main_grad - held, o, r)


@pytest.mark.parametrize("target_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pairs", [1, 8])
def test_add_into_is_the_foreach_addition_in_one_launch(monkeypatch, target_dtype, pairs):
    """The fused head's parameter gradients into ``main_grad``: each target plus its fp32 source in fp32, rounded
    once to the target's dtype, in one launch whatever the sizes (off the block too). Into fp32, bit for bit
    ``Tensor.add_``; into bf16 within the rounding (the interpreter truncates to bf16 where GPUs round to nearest:
    tests/gpu/test_kernels_gpu.py holds the bf16 sum to ``Tensor.add_`` bit for bit)."""
    gen = torch.Generator().manual_seed(3)
    sizes = [1, 1024, 1025, 33, 5 * 32, 2048 + 7, 64, 3][:pairs]
    targets = [(10 * torch.randn(n, generator=gen)).to(target_dtype) for n in sizes]
    sources = [torch.randn(n, generator=gen) for n in sizes]
    exact = [t.double() + s.double() for t, s in zip(targets, sources)]
    expected = [t.clone().add_(s) for t, s in zip(targets, sources)]
    launches, launch = [], kernels.launch
    monkeypatch.setattr(kernels, "launch", lambda kernel, grid, *args, **kw: (launches.append(grid),
                                                                            launch(kernel, grid, *args, **kw)))
    kernels.add_into(targets, sources)
    assert len(launches) == 1 and launches[0][1] == pairs
    for got, want, oracle in zip(targets, expected, exact):
        if target_dtype == torch.float32:
            assert torch.equal(got, want)
        else:
            assert ((got.double() - oracle).abs() <= torch.finfo(target_dtype).eps * oracle.abs()).all()
    with pytest.raises(ValueError, match="at most 8 targets of one dtype"):
        kernels.add_into(targets[:1] + [torch.zeros(3, dtype=torch.float16)], sources[:1] + [torch.zeros(3)])
