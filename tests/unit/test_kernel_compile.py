"""Every Triton kernel compiles for NVIDIA sm_90 (H100/H200) and AMD gfx942 (MI300X) at ZAYA1-8B shapes.

No GPU needed: triton compiles for a named target on CPU (``compile_only``), with the launch settings of the
target's row in the kernels' tuning tables. Checked: it compiles, no register spills, shared memory within
the chip's per-block limit.
"""


import pytest
import torch

from triton_interpreter import SHARED_LIMIT, compile_only, gpu_target, load_kernel_module, register_spills

from megatron_zaya.ops.composite import Piece

TOKENS, HIDDEN, FFN, EXPERTS, VOCAB, ROUTER = 8192, 2048, 2048, 16, 262272, 256
BF16, FP32 = torch.bfloat16, torch.float32


def _meta(*shape, dtype=BF16):
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=dtype.is_floating_point)


def _backward(outputs):
    torch.autograd.backward(outputs, [torch.empty_like(o) for o in outputs])


def _rmsnorm(k):
    vectors = [_meta(HIDDEN) for _ in range(5)]
    _backward([k.rms_norm(_meta(TOKENS, HIDDEN), vectors[0], 1e-5)])
    _backward(list(k.residual_rms_norm(_meta(TOKENS, HIDDEN), _meta(TOKENS, HIDDEN, dtype=FP32), *vectors, 1e-5)))
    _backward([k.residual_norm(_meta(TOKENS, HIDDEN, dtype=FP32), vectors[0], 1e-5)])
    _backward([k.residual_merge(_meta(TOKENS, HIDDEN), _meta(TOKENS, HIDDEN, dtype=FP32), *vectors[:4])])
    wide = [_meta(4 * HIDDEN) for _ in range(5)]  # a wider model: fewer pipeline stages fit in shared memory
    _backward(list(k.residual_rms_norm(_meta(TOKENS, 4 * HIDDEN), _meta(TOKENS, 4 * HIDDEN, dtype=FP32), *wide, 1e-5)))


def _swiglu(k):
    fc1_out = _meta(TOKENS, 2 * FFN)
    _backward([k.swiglu(fc1_out)])
    _backward([k.swiglu(fc1_out, _meta(TOKENS, 1, dtype=FP32))])


def _router(k):
    logits, biases = _meta(TOKENS, EXPERTS + 1, dtype=FP32), _meta(EXPERTS + 1, dtype=FP32).detach()
    probs, _, skip_gate, _ = k.route_top1(logits, biases, EXPERTS)
    _backward([probs, skip_gate])
    u, state_in = _meta(TOKENS, ROUTER, dtype=FP32), _meta(TOKENS, ROUTER, dtype=FP32)
    params = [_meta(ROUTER), _meta(ROUTER), _meta(ROUTER, ROUTER), _meta(ROUTER), _meta(ROUTER, ROUTER), _meta(ROUTER),
              _meta(EXPERTS + 1, ROUTER)]  # fmt: skip
    probs, _, state, skip_gate, _ = k.route_head(u, state_in, *params, biases, 1e-5, EXPERTS)
    _backward([probs, state, skip_gate])
    # the projection's bias added by the head, the counts added into the step's (the moe op's call)
    counts_into = torch.empty(EXPERTS + 1, dtype=FP32, device="meta")
    arguments = k.route_head_arguments(u, state_in, *params, biases, 1e-5, EXPERTS, _meta(ROUTER), counts_into)
    probs, _, state, skip_gate, _ = k.RouteHead.apply(*arguments)
    _backward([probs, state, skip_gate])
    # the head's parameter gradients into a bf16 main_grad
    k.add_into([_meta(*p.shape).detach() for p in params], [_meta(*p.shape, dtype=FP32).detach() for p in params])


def _cross_entropy(k):
    labels = torch.zeros(TOKENS, dtype=torch.int64, device="meta")
    _backward([k.cross_entropy(_meta(TOKENS, VOCAB), labels)])
    _backward([k.linear_cross_entropy(_meta(TOKENS, HIDDEN), _meta(VOCAB, HIDDEN), labels)])


def _cca(k):
    seq, batch, n_q, n_kv, d, rot = TOKENS // 2, 2, 8, 2, 128, 64
    q_ch, k_ch = n_q * d, n_kv * d
    q0, k0 = _meta(seq, batch, q_ch), _meta(seq, batch, k_ch)
    convs = [_meta(q_ch, 2), _meta(q_ch), _meta(k_ch, 2), _meta(k_ch), _meta(q_ch, d, 2), _meta(q_ch),
             _meta(k_ch, d, 2), _meta(k_ch)]  # fmt: skip
    cos = _meta(seq, rot, dtype=FP32).detach()
    temp = _meta(n_kv)
    _backward(list(k.cca_qk(q0, k0, *convs, temp, cos, cos)))
    for param in (*convs, temp):  # as under Megatron's DDP: the parameters' gradients go into main_grad
        param.main_grad, param.grad_added_to_main_grad = torch.empty_like(param, dtype=FP32), False
    _backward(list(k.cca_qk(q0, k0, *convs, temp, cos, cos)))
    for offsets in (None, torch.empty(seq, batch, dtype=torch.int32, device="meta")):  # the value delay
        _backward([k.DelayChannels.apply(_meta(seq, batch, k_ch), k_ch // 2, None, offsets)])
        # under context parallelism: two chunks, each with the row before it
        previous = _meta(2, 1, batch, k_ch - k_ch // 2)
        _backward([k.DelayChannels.apply(_meta(seq, batch, k_ch), k_ch // 2, previous, offsets)])
    # the input gradient added into another (the cca_sublayer op's backward)
    convs = Piece(k.CausalConvs, k0.detach(), *(w.detach() for w in convs[2:4] + convs[6:8]), None, None)
    k.CausalConvs.backward_adding(convs, _meta(seq, batch, k_ch).detach(), _meta(seq, batch, k_ch).detach())


def _grouped_gemm(k):
    counts = torch.full((EXPERTS,), TOKENS // EXPERTS, dtype=torch.int64, device="meta")
    _backward([k.grouped_gemm(_meta(TOKENS, HIDDEN), _meta(EXPERTS, 2 * FFN, HIDDEN), counts)])
    # the experts' own weights by address, and a padded tail (the kernel's other specialisation)
    weights = [_meta(2 * FFN, HIDDEN) for _ in range(EXPERTS)]
    _backward([k.grouped_gemm(_meta(TOKENS, HIDDEN), weights, counts, padded_rows=True)])
    # the moe op's GEMMs, rows in token order through the sort's order: fc1 gathers x and scatters d x, fc2 scatters
    # its output; the experts' weights found through an offset table
    order, table = (torch.empty(n, dtype=torch.int64, device="meta") for n in (TOKENS, EXPERTS))
    for m_dim, k_dim, x_order, out_order in [(2 * FFN, HIDDEN, order, None), (HIDDEN, FFN, None, order)]:
        weights = [_meta(m_dim, k_dim)]
        k.matmul(_meta(TOKENS, k_dim), counts, True, table, weights, True, gather=x_order, scatter=out_order)
        k.matmul(_meta(TOKENS, m_dim), counts, True, table, weights, False, scatter=x_order)


def _sort_by_expert(k):
    routing_map = torch.empty(TOKENS, EXPERTS, dtype=torch.bool, device="meta")
    k.sort_by_expert(routing_map, 0, EXPERTS)
    k.sort_by_expert(routing_map, 0, EXPERTS, _meta(TOKENS, EXPERTS, dtype=FP32).detach())  # the gates sorted too
    # rows not 16-byte aligned (17 columns, or a view of a wider map): no vector loads, other layouts
    unaligned = torch.empty(TOKENS, EXPERTS + 1, dtype=torch.bool, device="meta")
    k.sort_by_expert(unaligned, 0, EXPERTS, _meta(TOKENS, EXPERTS + 1, dtype=FP32).detach())


# module: (run forward+backward on meta tensors, the kernels that must have been compiled)
CASES = {
    "residual_rmsnorm": (_rmsnorm, {"_norm_forward_kernel", "_norm_backward_kernel", "_norm_sum_partials_kernel"}),
    "swiglu": (_swiglu, {"_swiglu_forward_kernel", "_swiglu_backward_kernel"}),
    "router": (_router, {"_router_forward_kernel", "_router_backward_kernel", "_head_forward_kernel",
                         "_head_backward_kernel", "_add_into_kernel"}),
    "cross_entropy": (_cross_entropy, {"_logsumexp_kernel", "_cross_entropy_grad_kernel"}),
    "cca": (_cca, {"_qk_epilogue_forward_kernel", "_qk_epilogue_backward_kernel", "_conv_forward_kernel",
                   "_conv_grouped_grad_kernel", "_conv_depthwise_grad_kernel", "_conv_weight_grad_kernel",
                   "_conv_param_grads_kernel", "_sum_rows_kernel", "_delay_kernel"}),
    "grouped_gemm": (_grouped_gemm, {"_row_tiles_kernel", "_grouped_matmul_kernel", "_grouped_weight_grad_kernel"}),
    "sort_by_expert": (_sort_by_expert, {"_sort_by_expert_kernel"}),
}




@pytest.mark.parametrize("target_name", ["sm_90", "gfx942"])
@pytest.mark.parametrize("module_name", sorted(CASES))
def test_kernels_compile_without_spills(module_name, target_name, monkeypatch):
    module = load_kernel_module(f"megatron_zaya.kernels.{module_name}", interpret=False)
    target = gpu_target(target_name, module.triton)
    backend = {"cuda": "nvidia", "hip": "amd"}[target.backend]
    if backend not in module.triton.backends.backends:  # e.g. a ROCm build of triton may ship no nvidia backend
        pytest.skip(f"this triton has no {backend} backend to compile with")
    if hasattr(module, "platform"):  # launch with the target's tuning table row, not the meta device's ("cpu")
        monkeypatch.setattr(module, "platform", lambda device: {"sm_90": "cuda", "gfx942": "rocm"}[target_name])
    run, expected_kernels = CASES[module_name]
    with compile_only(module, target) as compiled:
        run(module)
    assert {kernel.name for kernel in compiled} == expected_kernels
    for kernel in compiled:
        spills, shared = register_spills(kernel, target_name, module.triton), kernel.metadata.shared
        assert spills == 0, f"{kernel.name} spills {spills} registers on {target_name}"
        assert shared <= SHARED_LIMIT[target_name], f"{kernel.name} needs {shared} B shared memory on {target_name}"
