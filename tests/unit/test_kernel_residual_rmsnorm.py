"""Residual-scaling + RMSNorm Triton kernels (CPU interpreter) against float64 torch."""

import pytest
import torch

from triton_interpreter import assert_matches_oracle, install, load_kernel_module

from megatron_zaya.ops import residual_norm as ops

kernels = load_kernel_module("megatron_zaya.kernels.residual_rmsnorm")
EPS = 1e-5


def _grads(outputs, inputs, grad_outputs):
    """d(outputs . grad_outputs) / d inputs, for inputs that require grad."""
    return torch.autograd.grad(outputs, inputs, [g.to(o.dtype) for o, g in zip(outputs, grad_outputs)])


def _leaves(*tensors, dtype=None):
    return [t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 96), (3, 5, 64)])
def test_rms_norm_forward_backward(dtype, shape):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(dtype) * 3
    weight = (1 + 0.5 * torch.randn(shape[-1], generator=gen)).to(dtype)
    grad = torch.randn(shape, generator=gen)

    runs = {}
    for name, fn, cast in [
        ("kernel", kernels.rms_norm, None),
        ("reference", ops.rms_norm, None),
        ("oracle", ops.rms_norm, torch.float64),
    ]:
        inputs = _leaves(x, weight, dtype=cast)
        out = fn(*inputs, EPS)
        runs[name] = (out, *_grads([out], inputs, [grad]))

    assert runs["kernel"][0].dtype == dtype
    for i, what in enumerate(["out", "d_x", "d_weight"]):
        assert_matches_oracle(what, runs["kernel"][i], runs["oracle"][i], runs["reference"][i])


@pytest.mark.parametrize("hidden_dtype", [torch.float32, torch.bfloat16])
def test_residual_rms_norm_forward_backward(hidden_dtype):
    gen = torch.Generator().manual_seed(1)
    rows, dim = 29, 80
    hidden = torch.randn(rows, dim, generator=gen).to(hidden_dtype)
    residual = torch.randn(rows, dim, generator=gen) * 4  # the fp32 residual stream
    # Vectors in mixed dtypes, as under Float16Module: biases/scales bf16 or fp32, norm weight in the model dtype.
    vectors = [
        (0.1 * torch.randn(dim, generator=gen)).to(hidden_dtype),  # hidden_bias
        (1 + 0.3 * torch.randn(dim, generator=gen)),  # hidden_scale (fp32)
        (0.1 * torch.randn(dim, generator=gen)).to(hidden_dtype),  # residual_bias
        (1 + 0.3 * torch.randn(dim, generator=gen)).to(hidden_dtype),  # residual_scale
        (1 + 0.3 * torch.randn(dim, generator=gen)).to(hidden_dtype),  # norm weight
    ]
    grad_normed = torch.randn(rows, dim, generator=gen)
    grad_residual = torch.randn(rows, dim, generator=gen)

    runs = {}
    for name, fn, cast in [
        ("kernel", kernels.residual_rms_norm, None),
        ("reference", ops.residual_rms_norm, None),
        ("oracle", ops.residual_rms_norm, torch.float64),
    ]:
        inputs = _leaves(hidden, residual, *vectors, dtype=cast)
        normed, new_residual = fn(*inputs, EPS)
        runs[name] = (normed, new_residual, *_grads([normed, new_residual], inputs, [grad_normed, grad_residual]))

    kernel = runs["kernel"]
    assert kernel[0].dtype == hidden_dtype and kernel[1].dtype == torch.float32
    assert kernel[2].dtype == hidden_dtype and kernel[3].dtype == torch.float32
    names = ["normed", "new_residual", "d_hidden", "d_residual", "d_hidden_bias", "d_hidden_scale",
             "d_residual_bias", "d_residual_scale", "d_weight"]  # fmt: skip
    for i, what in enumerate(names):
        assert_matches_oracle(what, kernel[i], runs["oracle"][i], runs["reference"][i])


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_residual_norm_rounds_the_fp32_stream_to_the_weight_dtype(weight_dtype):
    """``residual_norm(r, w)`` is ``rms_norm(r.to(w.dtype), w)`` with the cast inside the kernel; the gradient
    reaches the fp32 stream through the cast."""
    gen = torch.Generator().manual_seed(3)
    residual = torch.randn(23, 72, generator=gen) * 5  # fp32, many values not representable in bf16
    weight = (1 + 0.4 * torch.randn(72, generator=gen)).to(weight_dtype)
    grad = torch.randn(23, 72, generator=gen)

    runs = {}
    for name, fn, cast in [
        ("kernel", kernels.residual_norm, None),
        ("reference", ops.residual_norm, None),
        ("oracle", lambda r, w, eps: ops.rms_norm(r.to(weight_dtype).double(), w, eps), torch.float64),
    ]:
        r, w = _leaves(residual, dtype=torch.float32 if cast is None else cast)[0], _leaves(weight, dtype=cast)[0]
        out = fn(r, w, EPS)
        runs[name] = (out, *_grads([out], [r, w], [grad]))

    kernel = runs["kernel"]
    assert kernel[0].dtype == weight_dtype and kernel[1].dtype == torch.float32
    for i, what in enumerate(["out", "d_residual", "d_weight"]):
        assert_matches_oracle(what, kernel[i], runs["oracle"][i], runs["reference"][i])


def test_the_norm_backward_adds_the_streams_other_gradient():
    """``RMSNorm.backward_adding``: the fp32 stream's gradient is the norm's plus another one (the layer reading
    the stream beside the norm), bit for bit what autograd's sum of the two gives, and the weight's is unchanged."""
    from megatron_zaya.ops.composite import Piece

    gen = torch.Generator().manual_seed(5)
    residual = torch.randn(4, 7, 72, generator=gen) * 5
    weight = (1 + 0.4 * torch.randn(72, generator=gen)).to(torch.bfloat16)
    grad = torch.randn(4, 7, 72, generator=gen).to(torch.bfloat16)
    other = torch.randn(4, 7, 72, generator=gen)

    norm = Piece(kernels.RMSNorm, residual, weight, EPS, True)
    d_x, d_weight, _, _ = norm.backward(grad)
    d_x_added, d_weight_added, _, _ = kernels.RMSNorm.backward_adding(norm, grad, other)
    assert torch.equal(d_x_added, d_x + other) and not torch.equal(d_x_added, d_x)
    assert torch.equal(d_weight_added, d_weight)
    r, w = _leaves(residual, weight, dtype=torch.float64)
    oracle = _grads([ops.rms_norm(r.to(torch.bfloat16).double(), w, EPS)], [r], [grad])[0] + other.double()
    r, w = _leaves(residual, weight)
    reference = _grads([ops.residual_norm(r, w, EPS)], [r], [grad])[0] + other
    assert_matches_oracle("d_residual", d_x_added, oracle, reference)
    with pytest.raises(ValueError, match="other gradient"):
        kernels.RMSNorm.backward_adding(norm, grad, other.to(torch.bfloat16))


# fp32 multiplies, additions and FMAs in a compiled kernel, by target.
_FP32_OPS = {"sm_90": {"fma": r"\bfma\.rn\.f32", "mul": r"\bmul(\.rn)?\.f32", "add": r"\badd(\.rn)?\.f32"},
             "gfx942": {"fma": r"\bv_(pk_)?fmac?_f32", "mul": r"\bv_(pk_)?mul_f32", "add": r"\bv_(pk_)?add_f32"}}


@pytest.mark.parametrize("target_name", ["sm_90", "gfx942"])
def test_the_added_gradient_is_a_plain_addition_on_gpus(target_name, monkeypatch):
    """On a GPU the compiler fuses a multiply into the addition that uses it (an FMA, rounded once): x's gradient
    plus the other one must stay the norm's rounded gradient plus the other, as autograd's separate sum (bit for
    bit: tests/gpu/test_training_gpu.py). The norm's backward compiled for an H100 and an MI300X (``compile_only``,
    ZAYA1-8B's width), without and with the addition: the products are as many, and each added one is a plain
    addition of its own (its product an FMA with 0)."""
    import re

    from triton_interpreter import compile_only, gpu_target

    from megatron_zaya.ops.composite import Piece

    module = load_kernel_module("megatron_zaya.kernels.residual_rmsnorm", interpret=False)
    target = gpu_target(target_name, module.triton)
    if {"cuda": "nvidia", "hip": "amd"}[target.backend] not in module.triton.backends.backends:
        pytest.skip(f"this triton cannot compile for {target_name}")
    monkeypatch.setattr(module, "platform", lambda device: {"sm_90": "cuda", "gfx942": "rocm"}[target_name])
    residual = torch.empty(8192, 2048, device="meta")
    weight, grad = torch.empty(2048, dtype=torch.bfloat16, device="meta"), torch.empty_like(residual)
    with compile_only(module, target) as compiled:
        norm = Piece(module.RMSNorm, residual, weight, EPS, True)
        module.RMSNorm.backward(norm, grad)
        module.RMSNorm.backward_adding(norm, grad, torch.empty_like(residual))
    plain, adding = [kernel.asm["ptx" if target_name == "sm_90" else "amdgcn"] for kernel in compiled
                     if kernel.name == "_norm_backward_kernel"]
    plain, adding = ({op: len(re.findall(pattern, asm)) for op, pattern in _FP32_OPS[target_name].items()}
                     for asm in (plain, adding))
    added = adding["add"] - plain["add"]
    assert added > 0 and adding["fma"] - plain["fma"] == added, (plain, adding)
    assert adding["fma"] + adding["mul"] == plain["fma"] + plain["mul"], (plain, adding)


@pytest.mark.parametrize("hidden_dtype", [torch.float32, torch.bfloat16])
def test_residual_merge_forward_backward(hidden_dtype):
    gen = torch.Generator().manual_seed(4)
    rows, dim = 31, 56
    hidden = torch.randn(rows, dim, generator=gen).to(hidden_dtype)
    residual = torch.randn(rows, dim, generator=gen) * 4
    vectors = [(0.1 * torch.randn(dim, generator=gen)).to(hidden_dtype), 1 + 0.3 * torch.randn(dim, generator=gen),
               (0.1 * torch.randn(dim, generator=gen)).to(hidden_dtype),
               (1 + 0.3 * torch.randn(dim, generator=gen)).to(hidden_dtype)]
    grad = torch.randn(rows, dim, generator=gen)

    runs = {}
    for name, fn, cast in [
        ("kernel", kernels.residual_merge, None),
        ("reference", ops.residual_merge, None),
        ("oracle", ops.residual_merge, torch.float64),
    ]:
        inputs = _leaves(hidden, residual, *vectors, dtype=cast)
        out = fn(*inputs)
        runs[name] = (out, *_grads([out], inputs, [grad]))

    kernel = runs["kernel"]
    assert kernel[0].dtype == torch.float32 and kernel[1].dtype == hidden_dtype
    names = ["new_residual", "d_hidden", "d_residual", "d_hidden_bias", "d_hidden_scale", "d_residual_bias",
             "d_residual_scale"]
    for i, what in enumerate(names):
        assert_matches_oracle(what, kernel[i], runs["oracle"][i], runs["reference"][i])


def test_reference_matches_transformers_zaya_modules():
    """The reference is transformers' ZayaResidualScaling followed by ZayaRMSNorm (fp32 parameters)."""
    from transformers.models.zaya.modeling_zaya import ZayaResidualScaling, ZayaRMSNorm

    gen = torch.Generator().manual_seed(2)
    scaling, norm = ZayaResidualScaling(48), ZayaRMSNorm(48, eps=EPS)
    with torch.no_grad():
        for p in [*scaling.parameters(), *norm.parameters()]:
            p.copy_(torch.randn(p.shape, generator=gen))
    hidden, residual = torch.randn(2, 7, 48, generator=gen), torch.randn(2, 7, 48, generator=gen)
    expected_residual = scaling(hidden, residual)
    normed, new_residual = ops.residual_rms_norm(
        hidden, residual, scaling.hidden_states_bias, scaling.hidden_states_scale,
        scaling.residual_bias, scaling.residual_scale, norm.weight, EPS,
    )  # fmt: skip
    torch.testing.assert_close(new_residual, expected_residual)
    torch.testing.assert_close(normed, norm(expected_residual))
    merged = ops.residual_merge(hidden, residual, scaling.hidden_states_bias,
                                              scaling.hidden_states_scale, scaling.residual_bias, scaling.residual_scale)
    torch.testing.assert_close(merged, expected_residual)


def test_triton_rms_norm_module_is_a_megatron_norm(monkeypatch):
    from types import SimpleNamespace

    install(monkeypatch, kernels)
    launches = []
    monkeypatch.setattr(kernels._norm_forward_kernel, "run", lambda *a, _run=kernels._norm_forward_kernel.run,
                        **k: launches.append(1) or _run(*a, **k))
    config = SimpleNamespace(sequence_parallel=True, normalization="RMSNorm", layernorm_zero_centered_gamma=False)
    norm = ops.TritonRMSNorm(config=config, hidden_size=64, eps=EPS)
    assert norm.weight.sequence_parallel and list(norm.state_dict()) == ["weight"]
    x = torch.randn(4, 2, 64)
    torch.testing.assert_close(norm(x), ops.rms_norm(x, norm.weight, EPS))
    assert launches  # the interpreted kernel, not the fallback
    with pytest.raises(ValueError, match="normalization"):
        ops.TritonRMSNorm(SimpleNamespace(**{**vars(config), "normalization": "LayerNorm"}), 64)


def test_bad_shapes_raise_clear_errors():
    with pytest.raises(ValueError, match=r"weight must have shape \[8\]"):
        kernels.rms_norm(torch.randn(2, 8), torch.ones(7), EPS)
    with pytest.raises(ValueError, match="exceed"):
        kernels.rms_norm(torch.randn(1, kernels.MAX_HIDDEN + 1), torch.ones(kernels.MAX_HIDDEN + 1), EPS)


@pytest.mark.parametrize("op", ["rms_norm", "residual_rms_norm", "residual_merge"])
def test_parameter_gradients_into_main_grad(op):
    """Under Megatron's DDP (each parameter with an fp32 ``main_grad``, holding earlier micro-batches' gradients),
    the kernel adds the parameters' gradients into ``main_grad`` in its reduction and marks them, for DDP's hooks
    to add nothing."""
    gen = torch.Generator().manual_seed(2)
    rows, dim = 21, 48
    hidden, residual, grad = (torch.randn(rows, dim, generator=gen) for _ in range(3))
    params = [1 + 0.3 * torch.randn(dim, generator=gen) for _ in range({"rms_norm": 1, "residual_merge": 4}.get(op, 5))]
    before = [torch.randn(dim, generator=gen) for _ in params]

    def run(fn, cast=None, main_grads=()):
        hidden_leaf, residual_leaf, *leaves = _leaves(hidden, residual, *params, dtype=cast)
        for leaf, held in zip(leaves, main_grads):
            leaf.main_grad, leaf.grad_added_to_main_grad = held.clone(), False
        args = (hidden_leaf, *leaves) if op == "rms_norm" else (hidden_leaf, residual_leaf, *leaves)
        out = fn(*args) if op == "residual_merge" else fn(*args, EPS)
        out = out[0] if isinstance(out, tuple) else out
        return leaves, torch.autograd.grad(out, leaves, grad.to(out.dtype))

    leaves, _ = run(getattr(kernels, op), main_grads=before)
    _, oracle = run(getattr(ops, op), torch.float64)
    for i, leaf in enumerate(leaves):
        assert leaf.grad_added_to_main_grad
        assert_matches_oracle(f"main_grad[{i}]", leaf.main_grad - before[i], oracle[i])
