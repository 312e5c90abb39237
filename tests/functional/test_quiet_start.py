"""A quiet start at any depth: what zaya-pretrain prints before its first iteration does not grow with the model.

Megatron lists every parameter of every gradient bucket (about 60 lines per ZAYA1 layer: the released 40-layer
model printed 2,668 lines before its first iteration) and logs its DDP, optimizer and dataset configs; those go
to the run's start log. A 40-layer model of the ``test`` preset's width has ZAYA1-8B's parameter list.
"""

from __future__ import annotations

import re

from zaya_cli import pretrain

from megatron_zaya.runtime import START_LOG_NAME
from megatron_zaya.training.arguments import preset_flags

MAX_LINES = 60
FIRST_ITERATION = re.compile(r"iteration\s+1/")


def _with_layers(flags: list[str], layers: int) -> list[str]:
    at = flags.index("--num-layers")
    return flags[:at + 1] + [str(layers)] + flags[at + 2:]


def test_forty_layers_start_in_at_most_60_console_lines(tmp_path):
    flags = _with_layers(preset_flags("test"), 40) + [
        "--mock-data", "--zaya-vocab-size", "512", "--seq-length", "32", "--micro-batch-size", "1",
        "--global-batch-size", "1", "--train-iters", "1", "--eval-iters", "0", "--log-interval", "1",
        "--save", "run", "--save-interval", "100"]  # fmt: skip
    run = pretrain(flags, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    # stdout and stderr as a console shows them (interleaving aside, each line is counted once)
    before = run.stdout[:FIRST_ITERATION.search(run.stdout).start()].splitlines() + run.stderr.splitlines()
    assert len(before) <= MAX_LINES, "\n".join(before)
    assert "decoder.layers.39." not in run.stdout + run.stderr
    start_log = (tmp_path / "run" / START_LOG_NAME).read_text()
    # every parameter of the last layer is listed there, with the configs
    assert start_log.count("decoder.layers.39.") >= 30 and "Setting up DistributedDataParallel" in start_log
    assert "Setting up optimizer with config" in start_log
