"""``--zaya-cuda-graphs`` refuses, in one line, the builds it cannot capture (the graphs themselves run on GPUs:
tests/gpu/test_cuda_graphs_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_zaya.config import zaya_config
from megatron_zaya.errors import ZayaConfigError
from megatron_zaya.model.cuda_graphs import check_cuda_graphs
from megatron_zaya.pretrained import build_single_process_model


def _config(**overrides):
    return zaya_config("test", use_cpu_initialization=True, params_dtype=torch.float32, **overrides)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_refused_without_a_gpu():
    with pytest.raises(ZayaConfigError, match=r"^--zaya-cuda-graphs with no CUDA/ROCm device: run on a GPU, or "):
        build_single_process_model(_config(cuda_graphs=True))


def _block(pp=1, cp=1, local_experts=True, grouped_experts=True):
    group = lambda size: SimpleNamespace(size=lambda: size)  # noqa: E731
    layer = SimpleNamespace(mlp=SimpleNamespace(_dispatches_locally=lambda: local_experts,
                                                experts=SimpleNamespace(grouped=grouped_experts)))
    return SimpleNamespace(pg_collection=SimpleNamespace(pp=group(pp), cp=group(cp)), layers=[layer, layer])


@pytest.mark.parametrize("layout, words", [
    (dict(pp=2), "pipeline parallelism: use --pipeline-model-parallel-size 1"),
    (dict(cp=2), "context parallelism: use --context-parallel-size 1"),
    (dict(local_experts=False), "experts spread over ranks: use --expert-model-parallel-size 1"),
    (dict(grouped_experts=False), "the experts' per-expert loop (a host sync): select the experts kernel"),
])
def test_refused_layouts(layout, words, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the layout checks, as a GPU machine runs them
    with pytest.raises(ZayaConfigError) as error:
        check_cuda_graphs(_block(**layout))
    assert words in str(error.value) and "\n" not in str(error.value)


def test_eager_build_is_unaffected():
    assert build_single_process_model(_config()).decoder.cuda_graphs is None


@pytest.mark.parametrize("first, named", [
    ("CUDA error: operation would make the legacy stream depend on a capturing stream\nmore",
     "CUDA error: operation would make the legacy stream depend on a capturing stream"),
    ("", "RuntimeError"),
])
def test_a_failed_capture_warns_with_the_error_it_began_with(first, named, monkeypatch, capsys):
    """Ending an invalidated capture raises its own error, chained to the first: the warning names the first (its
    type where it has no message)."""
    from megatron_zaya.model.cuda_graphs import LayerGraphs

    def capture(self, hidden, router_state, constants):
        try:  # as ``torch.cuda.graph``'s exit raises while the body's error propagates
            raise RuntimeError(first)
        finally:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    monkeypatch.setattr(LayerGraphs, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    assert LayerGraphs([])._capture_or_none(torch.zeros(2, 1, 4), None, {}) is None
    assert capsys.readouterr().err.splitlines() == [
        f"[zaya] warning: CUDA graph capture failed ({named}); these layers run eagerly"]
