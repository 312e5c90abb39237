"""On a GPU: packed documents through variable-length flash attention equal float64 attention within each
document (outputs and gradients), for full and sliding-window layers with grouped keys."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_zaya.model import documents

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or documents.varlen_attention() is None,
                                reason="needs a CUDA or ROCm GPU and torch's variable-length attention")


def _per_document_reference(q, k, v, positions, window):
    """float64 SDPA of each document alone: q ``[s, b, h, d]``, k, v ``[s, b, g, d]`` -> ``[s, b, h * d]``."""
    s, b, heads, d = q.shape
    out = torch.zeros(s, b, heads, d, dtype=torch.float64, device=q.device)
    for row in range(b):
        starts = (positions[:, row] == 0).nonzero().flatten().tolist()
        for start, end in zip(starts, starts[1:] + [s]):
            qd, kd, vd = (t[start:end, row].double().transpose(0, 1) for t in (q, k, v))
            kd, vd = (t.repeat_interleave(heads // t.shape[0], dim=0) for t in (kd, vd))
            n = end - start
            i, j = torch.arange(n, device=q.device)[:, None], torch.arange(n, device=q.device)[None, :]
            mask = (j <= i) & ((i - j < window) if window else True)
            out[start:end, row] = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask).transpose(0, 1)
    return out.reshape(s, b, heads * d)


@pytest.mark.parametrize("attention_type", ["global", "sliding"])
def test_varlen_attention_matches_float64_per_document(attention_type):
    from megatron_zaya.config import zaya_config
    from megatron_zaya.model.core_attention import SDPAttention

    cfg = zaya_config("test", num_layers=1, attention_types=[attention_type], sliding_window=48)
    attention = SDPAttention(cfg, layer_number=1)
    generator = torch.Generator(device="cuda").manual_seed(0)
    s, b, heads, groups, d = 512, 2, 8, 2, 64
    lengths = [[1, 3, 200, 7, 301], [512]]  # a length-1 document, short ones, one longer than the window
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths], dim=1).cuda()
    q = torch.randn(s, b, heads, d, device="cuda", dtype=torch.bfloat16, generator=generator)
    k, v = (torch.randn(s, b, groups, d, device="cuda", dtype=torch.bfloat16, generator=generator) for _ in "kv")
    grad = torch.randn(s, b, heads * d, device="cuda", dtype=torch.float64, generator=generator)
    window = cfg.sliding_window if attention_type == "sliding" else None

    bounds = documents.varlen_documents(positions).bounds
    assert bounds.cu_seqlens_q.tolist() == [0, 1, 4, 204, 211, 512, 1024] and bounds.max_seqlen_q == 512
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*inputs, attention_mask=documents.document_ids(positions), packed_seq_params=bounds)
    (out.double() * grad).sum().backward()
    reference_inputs = [t.double().requires_grad_() for t in (q, k, v)]
    reference = _per_document_reference(*reference_inputs, positions, window)
    (reference * grad).sum().backward()

    def relative(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    assert relative(out, reference) <= 1e-2
    for mine, theirs in zip(inputs, reference_inputs, strict=True):
        assert relative(mine.grad, theirs.grad) <= 2e-2
