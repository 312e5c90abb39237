"""The node self-test: a healthy CPU passes, and the ECC counters of nvidia-smi and amd-smi are read
from the tools' real output formats (fake tools on PATH print them). A failing node through the CLI:
tests/functional/test_watchdog_cli.py."""

from __future__ import annotations

import json

import torch

from megatron_zaya.training import health


def _tool(directory, name, output):
    path = directory / name
    path.write_text(f"#!/bin/sh\nprintf '%s\\n' '{output}'\n")  # printf: a shell builtin, PATH holds only the fakes
    path.chmod(0o755)


def test_a_healthy_cpu_passes():
    assert health.self_test(torch.device("cpu"), check_ecc=False) == []


def test_a_wrong_gemm_is_named(monkeypatch):
    monkeypatch.setattr(health, "_device_gemm", lambda a, b: (a @ b).half().float() + 1)
    (problem,) = health.self_test(torch.device("cpu"), check_ecc=False)
    assert problem.startswith("a 512x512 float32 GEMM is off its float64 reference by ")


def test_ecc_counters_are_read_from_whichever_tool_is_installed(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert health.ecc_problems() == []  # no tool
    _tool(tmp_path, "nvidia-smi", "0, 0\n1, 3\n2, [N/A]")
    assert health.ecc_problems() == ["GPU 1 has 3 uncorrectable ECC errors (nvidia-smi)"]
    (tmp_path / "nvidia-smi").unlink()
    # amd-smi metric --ecc --json: ROCm 6 prints a list of GPUs, ROCm 7 {"gpu_data": [...]} with per-block counters
    # (parts of the total) and "N/A" where a counter is unsupported.
    rocm6 = [{"gpu": 0, "ecc": {"total_correctable_count": 5, "total_uncorrectable_count": 0}},
             {"gpu": 1, "ecc": {"total_correctable_count": 0, "total_uncorrectable_count": 2}}]
    _tool(tmp_path, "amd-smi", json.dumps(rocm6))
    assert health.ecc_problems() == ["GPU 1 has 2 uncorrectable ECC errors (amd-smi)"]
    blocks = {"UMC": {"correctable_count": 0, "uncorrectable_count": 3, "deferred_count": 0},
              "GFX": {"correctable_count": 0, "uncorrectable_count": 1, "deferred_count": 0}}
    rocm7 = {"gpu_data": [
        {"gpu": 0, "ecc": {"total_correctable_count": "N/A", "total_uncorrectable_count": "N/A"}},
        {"gpu": 3, "ecc": {"total_correctable_count": 0, "total_uncorrectable_count": 4, "total_deferred_count": 0,
                           "cache_correctable_count": 0, "cache_uncorrectable_count": 0}, "ecc_blocks": blocks}]}
    _tool(tmp_path, "amd-smi", json.dumps(rocm7))
    assert health.ecc_problems() == ["GPU 3 has 4 uncorrectable ECC errors (amd-smi)"]
    _tool(tmp_path, "amd-smi", "usage: amd-smi metric [-h] (no --json here)")
    assert health.ecc_problems() == []
