"""Every command of README.md and docs/training.md: each is run here, as written with what only a cluster has
swapped for this machine's (2 gloo ranks for 8 GPUs, the embedded tokenizer for a hub name, the test model's
shape and two steps appended to the flags), or named with the test that runs it."""

from __future__ import annotations

import gzip
import re
import shlex
import subprocess
import sys
from pathlib import Path

from zaya_cli import losses

from megatron_zaya.data import embedded_tokenizer_dir
from megatron_zaya.data.embedded import EMBEDDED_CORPUS

REPO = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/training.md")

# Documented commands that this file does not run: the test that runs each, or why none can here.
ELSEWHERE = {
    "make train": "tests/functional/test_pretrain_cli.py (the main job: zaya-pretrain without data flags)",
    "make test": "the suite itself",
    "zaya-pretrain --zaya-preset zaya1-8b-shallow --mock-data": "a GPU only (--zaya-cuda-graphs)",
    "zaya-convert import-hf": "tests/functional/test_hf_round_trip.py",
    "zaya-pretrain --zaya-preset zaya1-8b --load": "tests/functional/test_hf_round_trip.py (the command import-hf "
                                                   "prints)",
    "zaya-convert export-hf": "tests/functional/test_hf_round_trip.py, tests/functional/test_user_paths.py",
}
RUN_HERE = ("zaya-preprocess corpus/*.jsonl", "zaya-torchrun --nproc-per-node 8 -m megatron_zaya.pretrain")

# The test model's shape (the documented preset's other settings stay), the embedded tokenizer's vocabulary, and
# two short steps; a checkpoint at the end.
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--kv-channels", "16",
         "--ffn-hidden-size", "96", "--moe-ffn-hidden-size", "96", "--num-experts", "4", "--zaya-router-hidden-size",
         "32", "--zaya-vocab-size", "4096", "--seq-length", "64", "--global-batch-size", "4", "--train-iters", "2",
         "--lr-warmup-iters", "1", "--save-interval", "2", "--split", "98,2,0", "--eval-iters", "0",
         "--log-interval", "1"]


def documented_commands() -> list[str]:
    """The commands of the docs' ``bash`` blocks, continuation lines joined, comments dropped."""
    commands = []
    for doc in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", (REPO / doc).read_text(), re.S):
            for line in re.sub(r"\\\n\s*", "", block).splitlines():
                command = line.split(" #")[0].strip()
                if command and not command.startswith("#"):
                    commands.append(command)
    return commands


def here(command: str, cwd: Path) -> list[str]:
    """The command with this machine's resources for the cluster's, its globs expanded in ``cwd`` as a shell would."""
    words = shlex.split(command.replace("google/gemma-3-4b-pt", embedded_tokenizer_dir()))
    swaps = {"--nproc-per-node": "2", "--workers": "2"}
    words = [swaps.get(words[i - 1], word) if i else word for i, word in enumerate(words)]
    words = [match for word in words
             for match in (sorted(str(p.relative_to(cwd)) for p in cwd.glob(word)) if "*" in word else [word])]
    if words[0] == "zaya-torchrun":
        return [sys.executable, "-m", "megatron_zaya.launch", "--standalone", *words[1:], *SMALL]
    assert words[0] == "zaya-preprocess"
    return [sys.executable, "-m", "megatron_zaya.data.preprocess", *words[1:]]


def test_every_documented_command_runs_here_or_is_named(tmp_path):
    commands = documented_commands()
    unaccounted = [c for c in commands if not c.startswith(RUN_HERE) and not c.startswith(tuple(ELSEWHERE))]
    assert not unaccounted, f"documented commands no test runs: {unaccounted}"

    (tmp_path / "corpus").mkdir()
    (tmp_path / "data").mkdir()
    with gzip.open(EMBEDDED_CORPUS, "rt") as lines:
        chapters = lines.read().splitlines()
    for part in range(2):
        (tmp_path / f"corpus/part{part}.jsonl").write_text("\n".join(chapters[part * 30:(part + 1) * 30]) + "\n")
    runs = [c for c in commands if c.startswith(RUN_HERE)]
    assert len(runs) == 4  # README: preprocess, 8 GPUs; training.md: preprocess (the same), 32k context
    for command in dict.fromkeys(runs):  # each distinct command once
        argv = here(command, tmp_path)
        run = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, (command, run.stderr[-3000:])
        if argv[2] == "megatron_zaya.launch":
            assert sorted(losses(run.stdout)) == [1, 2], command
            save = argv[argv.index("--save") + 1]
            assert (tmp_path / save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
