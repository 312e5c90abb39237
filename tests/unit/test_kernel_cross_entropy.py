"""Cross-entropy and chunked LM-head cross-entropy Triton kernels (CPU interpreter) against float64 torch."""

import pytest
import torch

from triton_interpreter import assert_matches_oracle, load_kernel_module

from megatron_zaya.ops import lm_head as ops

kernels = load_kernel_module("megatron_zaya.kernels.cross_entropy")
VOCAB = 300


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(kernels, "BLOCK_V", 64)  # several column blocks per row, a ragged last one


def _labels(shape, gen):
    labels = torch.randint(0, VOCAB, shape, generator=gen)
    labels.view(-1)[::7] = kernels.IGNORE_INDEX
    return labels


def _loss_and_grads(fn, tensors, labels, grad_loss, dtype=None, **kwargs):
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]
    loss = fn(*leaves, labels, **kwargs)
    return [loss, *torch.autograd.grad(loss, leaves, grad_loss.to(loss.dtype))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_forward_backward(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(5, 3, VOCAB, generator=gen)).to(dtype)
    labels = _labels((5, 3), gen)
    grad_loss = torch.rand(5, 3, generator=gen)

    kernel = _loss_and_grads(kernels.cross_entropy, [logits], labels, grad_loss)
    reference = _loss_and_grads(ops.cross_entropy, [logits], labels, grad_loss)
    oracle = _loss_and_grads(ops.cross_entropy, [logits], labels, grad_loss, torch.float64)
    assert kernel[0].dtype == torch.float32 and kernel[1].dtype == dtype
    assert (kernel[0][labels == kernels.IGNORE_INDEX] == 0).all()
    for name, k, r, o in zip(["loss", "d_logits"], kernel, reference, oracle):
        assert_matches_oracle(name, k, o, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunks", [(None, None), (8, 128)])  # one tile; 3 x 3 ragged tiles (3 token chunks)
@pytest.mark.parametrize("grad_in_forward", [True, False], ids=["grad_in_forward", "recompute"])
@pytest.mark.parametrize("grad_kind", ["one_factor", "per_token"])  # Megatron's loss; a loss mask or weights
def test_linear_cross_entropy_forward_backward(dtype, chunks, grad_in_forward, grad_kind):
    gen = torch.Generator().manual_seed(1)
    tokens, dim = 19, 24
    hidden = torch.randn(tokens, dim, generator=gen).to(dtype)
    weight = (0.5 * torch.randn(VOCAB, dim, generator=gen)).to(dtype)
    labels = _labels((tokens,), gen)
    grad_loss = torch.rand(tokens, generator=gen) if grad_kind == "per_token" else torch.full((tokens,), 0.37)
    token_chunk, vocab_chunk = chunks

    kernel = _loss_and_grads(kernels.linear_cross_entropy, [hidden, weight], labels, grad_loss,
                             token_chunk=token_chunk, vocab_chunk=vocab_chunk,
                             grad_in_forward=grad_in_forward)  # fmt: skip
    reference = _loss_and_grads(ops.linear_cross_entropy, [hidden, weight], labels, grad_loss)
    oracle = _loss_and_grads(ops.linear_cross_entropy, [hidden, weight], labels, grad_loss, torch.float64)
    assert kernel[0].dtype == torch.float32 and kernel[1].dtype == kernel[2].dtype == dtype
    checked = ["loss", "d_hidden", "d_weight"]
    if grad_in_forward and grad_kind == "per_token":  # d weight of the forward holds for one factor: NaN, not wrong
        assert kernel[2].isnan().all()
        checked = checked[:2]
    for name, k, r, o in zip(checked, kernel, reference, oracle):
        assert_matches_oracle(name, k, o, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_grad_chunks", [2, 5])  # groups of 2 and 1 of the 3 chunks; all 3 in one group
def test_the_forwards_weight_gradient_over_groups_of_chunks(dtype, weight_grad_chunks):
    """One weight-gradient GEMM per group of token chunks, their logits' gradients side by side: the same gradients."""
    gen = torch.Generator().manual_seed(2)
    tokens, dim = 19, 24
    hidden = torch.randn(tokens, dim, generator=gen).to(dtype)
    weight = (0.5 * torch.randn(VOCAB, dim, generator=gen)).to(dtype)
    labels = _labels((tokens,), gen)
    grad_loss = torch.full((tokens,), 0.37)
    kernel = _loss_and_grads(kernels.linear_cross_entropy, [hidden, weight], labels, grad_loss, token_chunk=8,
                             weight_grad_chunks=weight_grad_chunks)
    reference = _loss_and_grads(ops.linear_cross_entropy, [hidden, weight], labels, grad_loss)
    oracle = _loss_and_grads(ops.linear_cross_entropy, [hidden, weight], labels, grad_loss, torch.float64)
    for name, k, r, o in zip(["loss", "d_hidden", "d_weight"], kernel, reference, oracle):
        assert_matches_oracle(name, k, o, r)


def test_a_loss_mask_given_as_ignored_labels_keeps_the_gradients_of_the_forward():
    """What training/steps.py does with Megatron's loss mask: masked tokens become ignored labels, so the loss
    gradient is one factor for every counted token and d weight from the forward holds (not NaN)."""
    gen = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(12, 16, generator=gen), 0.5 * torch.randn(VOCAB, 16, generator=gen)
    labels = torch.randint(0, VOCAB, (12,), generator=gen)
    mask = (torch.rand(12, generator=gen) > 0.3).float()
    ignored = labels.masked_fill(mask == 0, kernels.IGNORE_INDEX)

    def megatron_loss(fn, dtype, labels):
        leaves = [t.to(dtype).requires_grad_() for t in (hidden, weight)]
        loss = (fn(*leaves, labels) * mask.to(dtype)).sum() / mask.sum()  # loss_func, then the schedule's scale
        return [loss, *torch.autograd.grad(loss, leaves)]

    kernel = megatron_loss(kernels.linear_cross_entropy, torch.float32, ignored)
    reference = megatron_loss(ops.linear_cross_entropy, torch.float32, labels)
    oracle = megatron_loss(ops.linear_cross_entropy, torch.float64, labels)
    for name, k, r, o in zip(["loss", "d_hidden", "d_weight"], kernel, reference, oracle):
        assert_matches_oracle(name, k, o, r)


def test_linear_cross_entropy_with_every_token_ignored_has_zero_gradients():
    hidden, weight = torch.randn(6, 8, requires_grad=True), torch.randn(VOCAB, 8, requires_grad=True)
    labels = torch.full((6,), kernels.IGNORE_INDEX)
    loss = kernels.linear_cross_entropy(hidden, weight, labels)
    loss.sum().backward()
    assert (loss == 0).all() and (hidden.grad == 0).all() and (weight.grad == 0).all()


def test_chunks_cover_the_range_evenly():
    assert kernels._chunks(262272, 29000) == [(i * 26228, min((i + 1) * 26228, 262272)) for i in range(10)]
    assert kernels._chunks(5, 8) == [(0, 5)]


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="labels"):
        kernels.cross_entropy(torch.randn(4, 10), torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="weight"):
        kernels.linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 9), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="weight_grad_chunks"):
        kernels.linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long),
                                     weight_grad_chunks=0)


@pytest.mark.parametrize("chunks", [(None, None), (8, 128)])
@pytest.mark.parametrize("grad_in_forward", [True, False], ids=["grad_in_forward", "recompute"])
def test_the_weight_gradient_is_added_into_a_given_tensor_then_announced(chunks, grad_in_forward):
    """``weight_grad_into`` (Megatron's ``main_grad``): d weight is added into it in place, keeping what it held,
    none is returned, and ``weight_grad_ready`` is called once, after the addition; d hidden is unchanged."""
    gen = torch.Generator().manual_seed(5)
    tokens, dim = 19, 24
    hidden, weight = torch.randn(tokens, dim, generator=gen), 0.5 * torch.randn(VOCAB, dim, generator=gen)
    labels = _labels((tokens,), gen)
    grad_loss = torch.full((tokens,), 0.37)
    before = 0.01 * torch.randn(VOCAB, dim, generator=gen)
    into, seen_when_ready = before.clone(), []
    leaf = hidden.clone().requires_grad_()
    token_chunk, vocab_chunk = chunks
    loss = kernels.linear_cross_entropy(leaf, weight, labels, token_chunk=token_chunk, vocab_chunk=vocab_chunk,
                                        grad_in_forward=grad_in_forward, weight_grad_into=into,
                                        weight_grad_ready=lambda: seen_when_ready.append(into.clone()))
    (grad_hidden,) = torch.autograd.grad(loss, [leaf], grad_loss)

    reference = _loss_and_grads(ops.linear_cross_entropy, [hidden, weight], labels, grad_loss)
    oracle = _loss_and_grads(ops.linear_cross_entropy, [hidden, weight], labels, grad_loss, torch.float64)
    for name, k, r, o in zip(["loss", "d_hidden"], [loss, grad_hidden], reference, oracle):
        assert_matches_oracle(name, k, o, r)
    assert_matches_oracle("d_weight in main_grad", into - before, oracle[2])
    assert len(seen_when_ready) == 1 and torch.equal(seen_when_ready[0], into)
