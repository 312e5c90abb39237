"""CCA q/k Triton kernels (CPU interpreter) against the model's q/k (ops/cca.py) in float64, and that reference
against transformers' ZayaCCAProjection."""

import pytest
import torch
from cca_kernel_arguments import reference
from cca_kernel_arguments import kernel as with_angles
from triton_interpreter import assert_matches_oracle, load_kernel_module

from megatron_zaya.ops import cca as ops
from megatron_zaya.ops.cca import delay_channels
from megatron_zaya.ops.composite import Piece

kernels = load_kernel_module("megatron_zaya.kernels.cca")
kernel = with_angles(kernels)
SEQ, BATCH, N_Q, N_KV, HEAD_DIM, ROT, T0, T1 = 6, 2, 4, 2, 16, 8, 2, 2


def _inputs(dtype, rope_per_batch, gen):
    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(dtype)

    q_ch, k_ch = N_Q * HEAD_DIM, N_KV * HEAD_DIM
    tensors = [randn(SEQ, BATCH, q_ch), randn(SEQ, BATCH, k_ch),  # q0, k0
               randn(q_ch, T0, scale=0.5), randn(q_ch, scale=0.1), randn(k_ch, T0, scale=0.5), randn(k_ch, scale=0.1),
               randn(q_ch, HEAD_DIM, T1, scale=0.2), randn(q_ch, scale=0.1),
               randn(k_ch, HEAD_DIM, T1, scale=0.2), randn(k_ch, scale=0.1),
               (1 + 0.5 * torch.randn(N_KV, generator=gen)).to(dtype)]  # fmt: skip
    angles = torch.rand(SEQ, BATCH if rope_per_batch else 1, ROT // 2, generator=gen) * 6
    return tensors, torch.cat([angles, angles], dim=-1)  # NeoX layout


def _run(fn, tensors, angles, grads, dtype=None):
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]
    q, k = fn(*leaves, angles)
    return [q, k, *torch.autograd.grad([q, k], leaves, [g.to(q.dtype) for g in grads])]


NAMES = ["q", "k", "d_q0", "d_k0", "d_wq1", "d_bq1", "d_wk1", "d_bk1", "d_wq2", "d_bq2", "d_wk2", "d_bk2", "d_temp"]


@pytest.mark.parametrize("dtype,rope_per_batch", [(torch.float32, False), (torch.float16, True)])
def test_cca_qk_forward_backward(dtype, rope_per_batch):
    gen = torch.Generator().manual_seed(0)
    tensors, angles = _inputs(dtype, rope_per_batch, gen)
    # strided as the attention's backward gives them: [S, B] views of batch-major gradients
    grads = [torch.randn(BATCH, SEQ, heads, HEAD_DIM, generator=gen).transpose(0, 1) for heads in (N_Q, N_KV)]

    ours = _run(kernel, tensors, angles, grads)
    model = _run(reference, tensors, angles, grads)
    oracle = _run(reference, tensors, angles, grads, dtype=torch.float64)
    assert ours[0].shape == (SEQ, BATCH, N_Q, HEAD_DIM) and ours[0].dtype == dtype
    for name, k, r, o in zip(NAMES, ours, model, oracle):
        assert k.dtype == r.dtype, name
        assert_matches_oracle(name, k, o, r)


def test_parameter_gradients_into_main_grad():
    """Under Megatron's DDP (parameters as the modules hold them, depthwise weights [C, 1, t0], each with a
    ``main_grad`` holding earlier micro-batches' gradients), the convolutions' and the key temperature's
    gradients are added into ``main_grad`` and the parameters marked, for DDP's hooks to add nothing."""
    gen = torch.Generator().manual_seed(3)
    tensors, angles = _inputs(torch.float32, False, gen)
    grads = [torch.randn(SEQ, BATCH, heads, HEAD_DIM, generator=gen) for heads in (N_Q, N_KV)]
    params = [t.detach().clone().requires_grad_() for t in tensors[2:]]
    for i in (0, 2):  # the depthwise weights as the module's parameters
        params[i] = params[i].detach().unsqueeze(1).requires_grad_()
    before = [torch.randn(p.shape, generator=gen) for p in params]
    for param, held in zip(params, before):
        param.main_grad, param.grad_added_to_main_grad = held.clone(), False
    q, k = kernel(*tensors[:2], *params, angles)
    torch.autograd.grad([q, k], params, [g.to(q.dtype) for g in grads])

    model = _run(reference, tensors, angles, grads)
    oracle = _run(reference, tensors, angles, grads, dtype=torch.float64)
    for name, param, held, r, o in zip(NAMES[4:], params, before, model[4:], oracle[4:], strict=True):
        assert param.grad_added_to_main_grad, name
        assert_matches_oracle(name, (param.main_grad - held).view(o.shape), o, r)


def test_reference_matches_transformers_cca_projection_and_qk_norm():
    from transformers.models.zaya.configuration_zaya import ZayaConfig
    from transformers.models.zaya.modeling_zaya import ZayaCCAProjection, ZayaQKNorm, apply_rotary_pos_emb

    torch.manual_seed(0)
    config = ZayaConfig(hidden_size=32, num_attention_heads=N_Q, num_key_value_heads=N_KV, head_dim=HEAD_DIM,
                        num_hidden_layers=1, cca_time0=T0, cca_time1=T1)  # fmt: skip
    projection, qk_norm = ZayaCCAProjection(config, layer_idx=0), ZayaQKNorm(config)
    torch.nn.init.normal_(qk_norm.temp, 1.0, 0.3)
    for conv in (projection.conv_qk_depthwise, projection.conv_qk_grouped):
        torch.nn.init.normal_(conv.bias, 0.0, 0.3)  # nonzero biases: the padded positions matter
    hidden = torch.randn(BATCH, SEQ, 32)
    angles = torch.rand(BATCH, SEQ, ROT // 2) * 6
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    q_hf, k_hf, v_hf = projection(hidden, cache=None)
    q_hf, k_hf = qk_norm(q_hf, k_hf)
    q_hf, k_hf = apply_rotary_pos_emb(q_hf.transpose(1, 2), k_hf.transpose(1, 2), cos, sin)

    q_ch = N_Q * HEAD_DIM
    dw, gw = projection.conv_qk_depthwise, projection.conv_qk_grouped
    sbd = hidden.transpose(0, 1)  # Megatron's [S, B, D]
    q, k = reference(
        projection.q_proj(sbd), projection.k_proj(sbd),
        dw.weight[:q_ch, 0], dw.bias[:q_ch], dw.weight[q_ch:, 0], dw.bias[q_ch:],
        gw.weight[:q_ch], gw.bias[:q_ch], gw.weight[q_ch:], gw.bias[q_ch:],
        qk_norm.temp, torch.cat([angles, angles], -1).transpose(0, 1),
    )  # fmt: skip
    torch.testing.assert_close(q, q_hf.permute(2, 0, 1, 3))
    torch.testing.assert_close(k, k_hf.permute(2, 0, 1, 3))

    v_weight = torch.cat([projection.v_proj_current.weight, projection.v_proj_delayed.weight])
    v = delay_channels(torch.nn.functional.linear(sbd, v_weight), v_weight.shape[0] // 2)
    torch.testing.assert_close(v.view(SEQ, BATCH, N_KV, HEAD_DIM), v_hf.transpose(0, 1))


def test_value_time_delay_shifts_the_second_half_by_one_token():
    x, weight = torch.randn(5, 2, 8), torch.randn(6, 8)
    projected = x @ weight.t()
    v = delay_channels(projected, 3)
    torch.testing.assert_close(v[..., :3], projected[..., :3])
    torch.testing.assert_close(v[1:, :, 3:], projected[:-1, :, 3:])
    assert (v[0, :, 3:] == 0).all()


@pytest.mark.parametrize("chunks", [1, 3], ids=["whole", "context-parallel-chunks"])
@pytest.mark.parametrize("documents", [False, True], ids=["one-sequence", "packed-documents"])
def test_value_time_delay_kernel_equals_the_reference(documents, chunks):
    """The delay kernel, forward and backward (its gradient read through the strides autograd hands it), equals
    ``delay_channels``: a shift, so exactly, zeros at each document's first token too; in chunks (context
    parallelism), each shifted in from its own preceding row, which gets its gradient."""
    gen = torch.Generator().manual_seed(5)
    seq, batch, channels, first = 12, 3, 40, 17
    v = torch.randn(seq, batch, channels, generator=gen)
    previous = torch.randn(chunks, 1, batch, channels - first, generator=gen) if chunks > 1 else None
    offsets = None
    if documents:  # tokens before each one in its document: documents of 4, 1, 7 tokens; another cut per sequence
        offsets = torch.tensor([0, 1, 2, 3, 0, 0, 1, 2, 3, 4, 5, 6], dtype=torch.int32)[:, None].repeat(1, batch)
        offsets[7:, 1] = torch.arange(5, dtype=torch.int32)
    grad = torch.randn(batch, seq, channels, generator=gen).transpose(0, 1)  # strided, as from the attention

    def run(delay):
        leaves = [t.clone().requires_grad_() for t in (v, previous) if t is not None]
        out = delay(leaves[0], first, leaves[1] if chunks > 1 else None, offsets)
        out.backward(grad)
        return [out, *(leaf.grad for leaf in leaves)]

    for ours, expected in zip(run(kernels.DelayChannels.apply), run(delay_channels), strict=True):
        assert torch.equal(ours, expected)


def test_bad_shapes_raise_clear_errors():
    gen = torch.Generator().manual_seed(0)
    tensors, angles = _inputs(torch.float32, False, gen)
    with pytest.raises(ValueError, match="k0 width"):
        kernel(tensors[0], tensors[1][..., :-1], *tensors[2:], angles)
    with pytest.raises(ValueError, match="even rot"):
        kernel(*tensors, angles[..., :-1])


@pytest.mark.parametrize("fn", [kernel, reference], ids=["kernel", "reference"])
def test_chunks_with_history_equal_the_whole_sequence(fn):
    """Context parallelism: two chunks, each given the pre-conv q0‖k0 rows before it, give the whole sequence's
    q and k (the first chunk is preceded by zeros, as the sequence is)."""
    gen = torch.Generator().manual_seed(2)
    tensors, angles = _inputs(torch.float32, False, gen)
    whole = fn(*tensors, angles)
    halo, half = (T0 - 1) + (T1 - 1), SEQ // 2
    packed = torch.cat(tensors[:2], dim=-1)  # [S, B, q‖k]
    history = torch.stack([torch.zeros_like(packed[:halo]), packed[half - halo: half]])
    # Each chunk's rows in a [n·L] layout whose two chunks are swapped: chunk order comes from the history.
    swapped = [torch.cat([t[half:], t[:half]]) for t in tensors[:2]]
    chunked = fn(*swapped, *tensors[2:], torch.cat([angles[half:], angles[:half]]), history.flip(0))
    for got, want in zip(chunked, whole, strict=True):
        torch.testing.assert_close(torch.cat([got[half:], got[:half]]), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("taps", [(2, 2), (3, 2), (2, 3)])
@pytest.mark.parametrize("with_history", [False, True])
def test_convolution_kernels_equal_conv1d(taps, with_history):
    """The convolution kernels (interpreted, fp32) against torch's conv1d in float64, forward and every
    gradient, the history's included (context parallelism: three chunks)."""
    gen = torch.Generator().manual_seed(7)
    t0, t1 = taps
    seq, batch, heads, d = 15, 3, 3, 16

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).requires_grad_()

    args = [randn(seq, batch, heads * d), randn(heads * d, t0), randn(heads * d), randn(heads * d, d, t1, scale=0.3),
            randn(heads * d)]  # fmt: skip
    if with_history:
        args.append(randn(3, t0 + t1 - 2, batch, heads * d))
    grad = torch.randn(seq, batch, heads * d, generator=gen, dtype=torch.float64)
    names = ["out", "d_x", "d_dw", "d_db", "d_gw", "d_gb", "d_history"]

    def run(fn, tensors):
        out = fn(*tensors[:5], heads, *tensors[5:])
        return [out, *torch.autograd.grad(out, tensors, grad.to(out.dtype))]

    fp32 = [t.detach().float().requires_grad_() for t in args]
    kernel = run(kernels.causal_qk_convs_fused, fp32)
    oracle = run(ops.causal_convs, args)
    for name, ours, want in zip(names, kernel, oracle):
        assert ours.dtype == torch.float32, name
        assert_matches_oracle(name, ours, want)


def _document_offsets(lengths: list[list[int]]) -> torch.Tensor:
    """[S, B]: each position's earlier tokens in its document, for documents of ``lengths`` per sequence."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths], dim=1)


# 15 positions (three chunks of 5 with history): length-1 documents, documents shorter than the halo, documents
# across chunk borders; a different packing per sequence.
DOCUMENTS = [[4, 1, 2, 6, 1, 1], [1, 7, 3, 4], [15]]


@pytest.mark.parametrize("taps", [(2, 2), (3, 2), (1, 4)])
def test_convolutions_with_documents_equal_each_document_alone(taps):
    """The reference, float64: packed documents give what each document gives on its own."""
    gen = torch.Generator().manual_seed(8)
    t0, t1 = taps
    heads, d = 2, 4
    x = torch.randn(15, len(DOCUMENTS), heads * d, generator=gen, dtype=torch.float64)
    weights = [torch.randn(heads * d, t0, generator=gen, dtype=torch.float64),
               torch.randn(heads * d, generator=gen, dtype=torch.float64),
               torch.randn(heads * d, d, t1, generator=gen, dtype=torch.float64),
               torch.randn(heads * d, generator=gen, dtype=torch.float64)]  # fmt: skip
    packed = ops.causal_convs(x, *weights, heads, document_offsets=_document_offsets(DOCUMENTS))
    for b, lengths in enumerate(DOCUMENTS):
        alone = [ops.causal_convs(piece, *weights, heads) for piece in x[:, b:b + 1].split(lengths)]
        torch.testing.assert_close(packed[:, b:b + 1], torch.cat(alone), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("taps", [(2, 2), (3, 2), (2, 3)])
@pytest.mark.parametrize("with_history", [False, True])
def test_convolution_kernels_with_documents_equal_the_reference(taps, with_history):
    """The convolution kernels with packed documents (interpreted, fp32) against the reference in float64,
    forward and every gradient, the history's included (context parallelism: three chunks)."""
    gen = torch.Generator().manual_seed(9)
    t0, t1 = taps
    seq, heads, d = 15, 2, 16
    batch = len(DOCUMENTS)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).requires_grad_()

    args = [randn(seq, batch, heads * d), randn(heads * d, t0), randn(heads * d), randn(heads * d, d, t1, scale=0.3),
            randn(heads * d), randn(3, t0 + t1 - 2, batch, heads * d) if with_history else None]  # fmt: skip
    offsets = _document_offsets(DOCUMENTS)
    grad = torch.randn(seq, batch, heads * d, generator=gen, dtype=torch.float64)
    names = ["out", "d_x", "d_dw", "d_db", "d_gw", "d_gb", "d_history"]

    def run(fn, tensors):
        out = fn(*tensors[:5], heads, tensors[5], offsets)
        leaves = [t for t in tensors if t is not None]
        return [out, *torch.autograd.grad(out, leaves, grad.to(out.dtype))]

    fp32 = [None if t is None else t.detach().float().requires_grad_() for t in args]
    kernel = run(kernels.causal_qk_convs_fused, fp32)
    oracle = run(ops.causal_convs, args)
    for name, ours, want in zip(names, kernel, oracle):
        assert_matches_oracle(name, ours, want)


@pytest.mark.parametrize("into_main_grad", [False, True], ids=["returned", "into-main-grad"])
def test_convolution_parameter_gradients_of_wide_heads(into_main_grad):
    """Heads of 64 channels (d b1 is derived in two blocks of input channels), the parameters as the modules hold
    them: their gradients returned, or (under Megatron's DDP: each ``main_grad`` a view into one fp32 buffer that
    holds earlier micro-batches' gradients) added into ``main_grad`` and the parameters marked; against the
    reference in float64."""
    gen = torch.Generator().manual_seed(10)
    seq, batch, heads, d, t0, t1 = 7, 2, 2, 64, 3, 2
    channels = heads * d

    def randn(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=gen, dtype=torch.float64)

    x, grad = randn(seq, batch, channels), randn(seq, batch, channels)
    weights = [randn(channels, 1, t0).requires_grad_(), randn(channels, scale=0.1).requires_grad_(),
               randn(channels, d, t1, scale=0.2).requires_grad_(), randn(channels, scale=0.1).requires_grad_()]
    out = ops.causal_convs(x, weights[0].squeeze(1), *weights[1:], heads)
    oracle = torch.autograd.grad(out, weights, grad)

    params = [w.detach().float().requires_grad_() for w in weights]
    buffer = torch.randn(sum(p.numel() for p in params), generator=gen)
    before = buffer.clone().split([p.numel() for p in params])
    if into_main_grad:
        for param, main_grad in zip(params, buffer.split([p.numel() for p in params])):
            param.main_grad, param.grad_added_to_main_grad = main_grad.view(param.shape), False
    returned = torch.autograd.grad(kernels.causal_qk_convs_fused(x.float(), *params, heads), params, grad.float())
    for name, param, held, got, want in zip(["d_dw", "d_db", "d_gw", "d_gb"], params, before, returned, oracle):
        if into_main_grad:
            assert param.grad_added_to_main_grad, name
            got = param.main_grad - held.view(param.shape)
        assert_matches_oracle(name, got, want)


def test_convolutions_add_the_input_gradient_into_another_as_torch_adds():
    """``backward_adding``: x's gradient added into another gradient of x by the convolutions' last kernel, bit for
    bit what ``torch.add`` of the two gives (the ``cca_sublayer`` op's sum of q0's gradients). In fp32: the
    interpreter does not round to bf16 as GPUs do; the bf16 sum is held to the layer op by op through the CLI in
    tests/gpu/test_training_gpu.py."""
    dtype = torch.float32
    gen = torch.Generator().manual_seed(11)
    seq, batch, heads, d, t0, t1 = 9, 2, 2, 16, 2, 2
    channels = heads * d

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(dtype)

    x, grad, other = randn(seq, batch, channels), randn(seq, batch, channels), randn(seq, batch, channels)
    weights = [randn(channels, t0, scale=0.5), randn(channels, scale=0.1), randn(channels, d, t1, scale=0.2),
               randn(channels, scale=0.1)]
    convs = Piece(kernels.CausalConvs, x, *weights, None, None)
    apart = convs.backward(grad)
    summed = kernels.CausalConvs.backward_adding(convs, grad, other.clone())
    assert torch.equal(summed[0], apart[0] + other)
    assert all(torch.equal(a, b) for a, b in zip(summed[1:5], apart[1:5]))
