"""On a GPU: ``--zaya-cuda-graphs`` (each layer's forward and backward replayed as CUDA graphs) computes what
the eager layers compute.

In process: two micro-batches accumulated into the gradients, the routers' token counts, then an in-place
weight update and another step (the graphs read the parameters where they live), against the same model run
eagerly. Through the CLI under ``--deterministic-mode``: the losses and gradient norms of 6 iterations (two
micro-batches each, distributed optimizer, balancing-bias updates) equal the eager run's bit for bit, on one
GPU (also with selective recomputation) and at DP2 with overlapped gradient reduction.

    .venv/bin/python -m pytest -q tests/gpu/test_cuda_graphs_gpu.py
"""

from __future__ import annotations

import re

import pytest
import torch
from zaya_cli import QUICK, losses, pretrain

from megatron_zaya.config import KERNEL_OPS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")

GRAD_NORM = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?grad norm: ([0-9.E+-]+)")
# Eager and graphed runs compute with the same kernels: every kernel op, named.
GRAPHED_KERNELS = ",".join(KERNEL_OPS)
# The tiny preset's 4 layers at the CLI tests' micro-batch: [sequence, micro-batch, hidden].
CAPTURED = "[zaya] CUDA graphs: captured the forward and backward of 4 layers for input [64, 4, 128]"


def _model(cuda_graphs: bool):
    from megatron_zaya.config import zaya_config
    from megatron_zaya.pretrained import build_single_process_model

    cfg = zaya_config("test", num_layers=3, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                      kv_channels=64, ffn_hidden_size=512, num_moe_experts=8, vocab_size=8192,
                      max_position_embeddings=1024, use_cpu_initialization=True, params_dtype=torch.bfloat16,
                      bf16=True, cuda_graphs=cuda_graphs, kernels=GRAPHED_KERNELS)
    torch.manual_seed(0)
    return build_single_process_model(cfg).cuda().train()


def _step(model, batches):
    """Forward + backward of each micro-batch, gradients accumulated: (losses, grads, routers' counts)."""
    model.zero_grad(set_to_none=True)
    step_losses = []
    for ids in batches:
        loss = model(ids, labels=ids).float().mean()
        loss.backward()
        step_losses.append(loss.detach())
    grads = {k: p.grad.float().clone() for k, p in model.named_parameters() if p.grad is not None}
    counts = torch.stack([layer.mlp.router.tokens_per_class.clone() for layer in model.decoder.layers])
    for layer in model.decoder.layers:
        layer.mlp.router.tokens_per_class.zero_()
    return torch.stack(step_losses), grads, counts


def _steps_agree(eager, graphed, batches, step: int) -> torch.Tensor:
    """One step of each model on the same micro-batches: losses within 1e-3, the routers' counts equal, every
    gradient within 1% (the backward's atomics differ from run to run). Returns the routers' counts."""
    want_loss, want_grads, want_counts = _step(eager, batches)
    got_loss, got_grads, got_counts = _step(graphed, batches)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-3, atol=0)
    assert torch.equal(got_counts, want_counts), step
    assert got_grads.keys() == want_grads.keys()
    for key, want in want_grads.items():
        error = ((got_grads[key] - want).norm() / want.norm().clamp_min(1e-12)).item()
        assert error <= 1e-2, (step, key, error)
    return want_counts


def _count_replays(monkeypatch) -> list[int]:
    """A counter of CUDA graph replays in this process (the layers' forward and backward graphs)."""
    replays, replay = [0], torch.cuda.CUDAGraph.replay

    def counted(graph):
        replays[0] += 1
        return replay(graph)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", counted)
    return replays


def test_graphed_layers_equal_eager_layers(monkeypatch):
    eager, graphed = _model(False), _model(True)
    graphed.load_state_dict(eager.state_dict())
    assert graphed.decoder.cuda_graphs is not None and eager.decoder.cuda_graphs is None
    replays = _count_replays(monkeypatch)
    generator = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, 8192, (2, 512), device="cuda", generator=generator) for _ in range(2)]
    for step in range(2):
        assert _steps_agree(eager, graphed, batches, step).sum() == 3 * 2 * 2 * 512, step
        # every micro-batch replays each of the 3 layers' forward and backward graphs: nothing ran eagerly
        assert graphed.decoder.cuda_graphs.captured_signatures == 1
        assert replays[0] == (step + 1) * 2 * 3 * 2, (step, replays)
        with torch.no_grad():  # the same in-place update on both: step 1 must see the new weights
            for model in (eager, graphed):
                for param in model.parameters():
                    if param.grad is not None:
                        param.sub_(param.grad, alpha=0.5)
    with torch.no_grad():  # evaluation runs the layers eagerly
        eager.eval(), graphed.eval()
        ids = batches[0][:, :256]
        torch.testing.assert_close(graphed(ids, labels=ids), eager(ids, labels=ids), rtol=1e-3, atol=1e-3)


def test_a_failed_capture_runs_the_layers_eagerly(capfd):
    """A host read inside a layer (what graph capture refuses, as ROCm refuses collectives in a capture) makes the
    capture fail: one warning line, then the eager run's losses and gradients, step after step, the caching
    allocator still empties its cache, and random ops still run."""
    eager, graphed = _model(False), _model(True)
    graphed.load_state_dict(eager.state_dict())
    attention = graphed.decoder.layers[1].self_attention
    forward = attention.forward  # (every kernel set calls it)

    def forward_with_host_read(hidden_states, *args, **kwargs):
        float(hidden_states.sum())  # a device-to-host copy: illegal while a stream is captured
        return forward(hidden_states, *args, **kwargs)

    attention.forward = forward_with_host_read
    generator = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, 8192, (2, 512), device="cuda", generator=generator) for _ in range(2)]
    for step in range(2):
        _steps_agree(eager, graphed, batches, step)
    warnings = [line for line in capfd.readouterr().err.splitlines() if "CUDA graph capture failed" in line]
    assert len(warnings) == 1 and warnings[0].startswith("[zaya] warning:"), warnings
    assert graphed.decoder.cuda_graphs.captured_signatures == 0
    # The allocator no longer routes to the failed graphs' pool: with the routing left on, this aborts the process.
    torch.cuda.empty_cache()
    # The default generator left capture mode: left in it, a random op outside a capture raises.
    assert torch.randn(4, device="cuda").isfinite().all()


@pytest.mark.parametrize("gpus, recompute", [(1, []), (2, []), (1, ["--recompute-granularity", "selective"])],
                         ids=["dp1", "dp2", "dp1-selective-recompute"])
def test_cli_with_graphs_repeats_the_eager_run(gpus, recompute, tmp_path):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    # DP2: Megatron's gradient hooks (overlapped reduce-scatter into the distributed optimizer's shards) fire
    # from the graphed layers' backward. Selective recomputation runs inside the captured backward.
    common = QUICK + ["--train-iters", "6", "--use-distributed-optimizer", "--bf16", "--lr", "3e-3",
                      "--deterministic-mode", "--save", "", "--zaya-kernels", GRAPHED_KERNELS, *recompute]
    common += ["--overlap-grad-reduce"] if gpus > 1 else []
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(gpus)))}
    runs = {}
    for name, flags in (("eager", []), ("graphs", ["--zaya-cuda-graphs"])):
        run = pretrain(common + flags, cwd=tmp_path, extra_env=env)
        assert run.returncode == 0, run.stderr[-3000:]
        runs[name] = (losses(run.stdout), {int(i): v for i, v in GRAD_NORM.findall(run.stdout)})
        captures = [line for line in run.stderr.splitlines() if line.startswith("[zaya] CUDA graph")]
        # graphed: one capture (every micro-batch has the same shape), then replays; a failed capture would warn
        assert captures == ([CAPTURED] if flags else []), captures
    assert sorted(runs["eager"][0]) == list(range(1, 7)), runs["eager"]
    assert runs["graphs"] == runs["eager"]
