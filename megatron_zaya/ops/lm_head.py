"""The LM head with the cross-entropy loss (docs/architecture.md §1); kernel op ``lm_head``.

ZAYA1's head is fp32: logits ``hidden.float() @ weight.float()ᵀ``, then the per-token cross-entropy. The kernel
(``kernels/cross_entropy.py``) multiplies the bf16 hidden states and weights with fp32 accumulation and output
(the products of the fp32 head) chunk by chunk, keeping only a per-token logsumexp: the [tokens, V] logits
(4.3 GB per 4096 tokens at V = 262k) never exist. Without it the model computes the logits with Megatron's
output layer and Megatron's loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .composite import off_the_graph

IGNORE_INDEX = -100  # labels that add no loss (torch's convention; the kernels' default too)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-token loss in fp32: logits [..., V], labels [...] -> [...]."""
    flat = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           reduction="none", ignore_index=ignore_index)  # fmt: skip
    return flat.view(labels.shape)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """LM head in fp32 then cross-entropy: hidden [..., D], weight [V, D], labels [...] -> loss [...] fp32."""
    return cross_entropy(hidden.float() @ weight.float().t(), labels, ignore_index)


# ----------------------------------------------------------------------------------------- the Triton kernels


def fused_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX):
    """:func:`cross_entropy` in one read of the logits forward (one read and write backward) where the kernel
    runs, else the reference."""
    from ..kernels import cross_entropy as kernel  # imported when first called: triton only where it is chosen

    if kernel.runs_on(logits, labels):
        return kernel.cross_entropy(logits, labels, ignore_index)
    return cross_entropy(logits, labels, ignore_index)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               ignore_index: int = IGNORE_INDEX, grad_in_forward: bool = True,
                               weight_shared: bool = False) -> torch.Tensor:
    """:func:`linear_cross_entropy` chunk by chunk without the logits where the kernel runs. ``grad_in_forward``
    computes the gradients during the forward (3 GEMMs, an fp32 [V, D] gradient held until the backward) instead
    of recomputing the logits in the backward (4 GEMMs).

    Under Megatron's DDP (``composite.off_the_graph``) the weight stays off autograd's graph: its gradient is added
    into its ``main_grad`` in place, with no [V, D] gradient tensor (at ZAYA1-8B's size the backward's peak is 3.2 GB
    lower), and the backward makes its ready call, unless ``weight_shared``: the embedding uses the same weight in
    this forward, so DDP's hook on it, after the embedding's gradient, does."""
    from ..kernels import cross_entropy as kernel
    from ..kernels.utils import main_grad_targets

    if not kernel.runs_on(hidden, weight, labels):
        return linear_cross_entropy(hidden, weight, labels, ignore_index)
    if hidden.requires_grad and off_the_graph([weight]) and main_grad_targets([weight]):
        return kernel.linear_cross_entropy(hidden, weight.detach(), labels, ignore_index,
                                           grad_in_forward=grad_in_forward, weight_grad_into=weight.main_grad,
                                           weight_grad_ready=None if weight_shared else weight.ddp_grad_ready)
    return kernel.linear_cross_entropy(hidden, weight, labels, ignore_index, grad_in_forward=grad_in_forward)


# ----------------------------------------------------------------------------------------- the choice


def choose(config, tensor_parallel_size: int):
    """:func:`fused_linear_cross_entropy` with the ``lm_head`` op where this rank holds the whole vocabulary, else
    None (Megatron's output layer and loss)."""
    return fused_linear_cross_entropy if config.uses_kernel("lm_head") and tensor_parallel_size == 1 else None
