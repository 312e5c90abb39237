"""A quiet start at any depth: what zaya-pretrain prints before its first iteration does not grow with the model.

Megatron lists every parameter of every gradient bucket (about 60 lines per ZAYA1 layer: the released 40-layer
model printed 2,668 lines before its first iteration) and logs its DDP, optimizer and dataset configs; those go
to the run's start log. A 40-layer model of the ``test`` preset's width has ZAYA1-8B's parameter list.
"""

from __future__ import annotations

import re

import pytest
from shared import once
from zaya_cli import pretrain

from megatron_zaya.runtime import START_LOG_NAME
from megatron_zaya.training.arguments import preset_flags

MAX_LINES = 60
FIRST_ITERATION = re.compile(r"iteration\s+1/")


def _with_layers(flags: list[str], layers: int) -> list[str]:
    at = flags.index("--num-layers")
    return flags[:at + 1] + [str(layers)] + flags[at + 2:]


@pytest.fixture(scope="module")
def forty_layers(tmp_path_factory):
    """One step of a 40-layer model, its balancing step size ramped over 10 steps (one run for every worker): the
    run directory, and the run's stdout and stderr."""

    def train(cwd):
        flags = _with_layers(preset_flags("test"), 40) + [
            "--mock-data", "--zaya-vocab-size", "512", "--seq-length", "32", "--micro-batch-size", "1",
            "--global-batch-size", "1", "--train-iters", "1", "--eval-iters", "0", "--log-interval", "1",
            "--save", "run", "--save-interval", "100", "--zaya-balancing-lr", "1e-2",
            "--zaya-balancing-warmup-steps", "10"]  # fmt: skip
        run = pretrain(flags, cwd=cwd)
        assert run.returncode == 0, run.stderr[-3000:]
        (cwd / "stdout.log").write_text(run.stdout)
        (cwd / "stderr.log").write_text(run.stderr)

    cwd = once(tmp_path_factory, "forty-layers", train)
    return cwd / "run", (cwd / "stdout.log").read_text(), (cwd / "stderr.log").read_text()


def test_forty_layers_start_in_at_most_60_console_lines(forty_layers):
    run_dir, stdout, stderr = forty_layers
    # stdout and stderr as a console shows them (interleaving aside, each line is counted once)
    before = stdout[:FIRST_ITERATION.search(stdout).start()].splitlines() + stderr.splitlines()
    assert len(before) <= MAX_LINES, "\n".join(before)
    assert "decoder.layers.39." not in stdout + stderr
    start_log = (run_dir / START_LOG_NAME).read_text()
    # every parameter of the last layer is listed there, with the configs
    assert start_log.count("decoder.layers.39.") >= 30 and "Setting up DistributedDataParallel" in start_log
    assert "Setting up optimizer with config" in start_log


def test_the_balancing_warm_up_through_the_cli(forty_layers):
    """Adam's first step moves each bias by its step size exactly (m / sqrt(v) = sign of the gradient): a tenth
    of --zaya-balancing-lr at the first of 10 warm-up steps, in every one of the 40 layers."""
    _, stdout, _ = forty_layers
    assert "iteration        1 | expert share max" in stdout
    assert "bias range: [-0.0010, 0.0010] |" in stdout, stdout[-2000:]
