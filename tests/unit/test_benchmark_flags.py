"""Benchmark flags that change what is measured: ``profile_layer --gemm-tuning`` takes only ``GEMM_TUNING``'s keys,
with integer values, and nonsense ends the command with one line and exit 2 before anything runs; ``--gaps`` runs;
``tune_launch --directions`` sweeps only the launches it names; ``tune_grouped_gemm --batch`` sets the tokens."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.profile_layer import gemm_tuning

REPO = Path(__file__).resolve().parents[2]


def test_gemm_tuning_reads_the_tables_keys_as_integers():
    assert gemm_tuning("wgrad_block_n=128,wgrad_warps=4") == {"wgrad_block_n": 128, "wgrad_warps": 4}


@pytest.mark.parametrize("value", ["wgrad_warps=four", "wgrad_warps"])
def test_a_value_that_is_no_integer_pair_is_refused(value):
    """A ValueError, which argparse reports as ``invalid gemm_tuning value`` in one line with exit 2."""
    with pytest.raises(ValueError):
        gemm_tuning(value)


def test_nonsense_is_one_line_and_exit_2():
    run = subprocess.run([sys.executable, "-m", "benchmarks.profile_layer", "--gemm-tuning", "wgrad_wraps=4"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 2 and last.endswith("--gemm-tuning: not in GEMM_TUNING: wgrad_wraps"), run.stderr[-2000:]


def test_profile_layer_gaps_runs_on_cpu():
    """``profile_layer --smoke --as-trained --gaps`` on CPU: the layer runs under Megatron's DDP, and with no device
    kernels the device is never idle between them (the gaps themselves: tests/unit/test_device_idle.py)."""
    run = subprocess.run([sys.executable, "-m", "benchmarks.profile_layer", "--smoke", "--as-trained", "--gaps",
                          "--steps", "1", "--top", "3"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "device idle between kernels: 0.000 ms/step" in run.stdout, run.stdout[-2000:]


def test_profile_layer_as_trained_aligns_each_main_grad():
    """``--as-trained`` lays out DDP's buffer as the distributed optimizer does, as the 40-layer runs train: every
    ``main_grad`` starts on 16 bytes (unpadded, the test layer's linear_q, _k and _v start 8 bytes off)."""
    code = ("from benchmarks.profile_layer import layer_step; step = layer_step(True, 32, 2, as_trained=True); "
            "print(sorted({p.main_grad.data_ptr() % 16 for p in step.layer.parameters()}))")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[0]", run.stdout[-2000:]


def test_tune_launch_sweeps_only_the_directions_it_is_given():
    """``tune_launch --kernel router_head --smoke --directions backward`` (the kernels under Triton's interpreter):
    the smoke's two backward candidates are timed, no forward one, and the best setting names backward keys only."""
    run = subprocess.run([sys.executable, "-m", "benchmarks.tune_launch", "--kernel", "router_head", "--smoke",
                          "--directions", "backward"], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert not [line for line in lines if line.startswith("forward:")], run.stdout[-2000:]
    assert len([line for line in lines if line.startswith("backward:") and line.endswith(" ms")]) == 2, lines
    best = ast.literal_eval(lines[-1].split(": ", 1)[1])
    assert best and all(key.startswith("backward_") for key in best), lines[-1]


def test_tune_launch_directions_nonsense_is_one_line_and_exit_2():
    run = subprocess.run([sys.executable, "-m", "benchmarks.tune_launch", "--directions", "sideways"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 2 and "--directions sideways: give forward, backward" in last, run.stderr


def test_tune_grouped_gemm_times_the_tokens_of_its_batch():
    """``tune_grouped_gemm --smoke --batch 3 --main-grad bf16`` (the kernels under Triton's interpreter): three
    sequences of the smoke shapes' 32 tokens."""
    run = subprocess.run([sys.executable, "-m", "benchmarks.tune_grouped_gemm", "--smoke", "--batch", "3",
                          "--main-grad", "bf16"], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "; 96 tokens; current" in run.stdout and "best (weight gradients" in run.stdout, run.stdout[-2000:]


def test_tune_grouped_gemm_batch_below_one_is_one_line_and_exit_2():
    run = subprocess.run([sys.executable, "-m", "benchmarks.tune_grouped_gemm", "--batch", "0"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 2 and last.endswith("--batch must be at least 1, got 0"), run.stderr[-2000:]
