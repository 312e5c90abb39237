"""zaya-pretrain on bad input: one line naming the problem and the fix, exit 2, nothing written."""

from __future__ import annotations

import pytest
from zaya_cli import QUICK, pretrain

CASES = {
    "unknown preset": (["--zaya-preset", "zaya9"], ["unknown preset", "zaya9"]),
    "missing data": (["--data-path", "/nonexistent/corpus_text_document", "--tokenizer-type", "NullTokenizer",
                      "--vocab-size", "4095"], ["/nonexistent/corpus_text_document", "zaya-preprocess"]),
    "sequence too long": (["--seq-length", "4096"], ["--seq-length 4096", "--max-position-embeddings 1024"]),
    "parallel sizes": (["--tensor-model-parallel-size", "3"], ["not divisible", "TP*PP*CP"]),
    "context parallel chunks": (["--context-parallel-size", "3"], ["--seq-length 64", "2*CP = 6"]),
    "tokenizer too large": (["--zaya-vocab-size", "1024"], ["4096 tokens", "1024"]),
    "save without interval": (["--mock-data", "--zaya-preset", "test", "--save-interval", "0"],
                              ["assert args.save_interval"]),
    "min lr above lr": (["--lr", "1e-4"], ["--min-lr 0.0003", "--lr 0.0001"]),
    "warmup too long": (["--lr-warmup-iters", "5"], ["--lr-warmup-iters 5", "decay length 5"]),
    "cuda graphs and overlapped gather": (["--zaya-cuda-graphs", "--use-distributed-optimizer",
                                           "--overlap-param-gather", "--overlap-grad-reduce"],
                                          ["--zaya-cuda-graphs", "--overlap-param-gather"]),
    "pipeline stages": (["--pipeline-model-parallel-size", "3"], ["--num-layers 4", "--pipeline-model-parallel-size 3"]),
    "document mask without position ids": (["--reset-attention-mask"], ["--reset-position-ids", "together"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input(case, tmp_path):
    flags, words = CASES[case]
    save = tmp_path / "ckpt"
    run = pretrain(QUICK + ["--train-iters", "5", "--save", str(save), "--load", str(save), *flags], cwd=tmp_path)
    assert run.returncode == 2, run.stderr[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("zaya-pretrain: error:") and all(w in last for w in words), last
    assert not save.exists()


def test_good_checkpoint_is_never_touched(tmp_path):
    """A failing launch against an existing checkpoint directory leaves it byte for byte as it was."""
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("7")
    before = {p: p.read_bytes() for p in save.rglob("*") if p.is_file()}
    run = pretrain(QUICK + ["--train-iters", "5", "--save", str(save), "--load", str(save), "--seq-length", "9999"],
                   cwd=tmp_path)
    assert run.returncode == 2
    assert {p: p.read_bytes() for p in save.rglob("*") if p.is_file()} == before


def test_checkpoint_of_another_architecture_is_refused(tmp_path):
    """Resuming with different model flags names the differing fields instead of failing on shapes."""
    save = tmp_path / "ckpt"
    first = pretrain(QUICK + ["--train-iters", "3", "--save", str(save), "--load", str(save)], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    before = {p: p.read_bytes() for p in save.rglob("*") if p.is_file()}
    run = pretrain(QUICK + ["--train-iters", "4", "--save", str(save), "--load", str(save), "--zaya-preset", "tiny", "--num-layers", "2",
                            "--zaya-cca-time0", "3"], cwd=tmp_path)
    assert run.returncode == 2
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("zaya-pretrain: error:") and "num_layers: 4 in the checkpoint, 2 here" in last, last
    assert "cca_time0" in last
    assert {p: p.read_bytes() for p in save.rglob("*") if p.is_file()} == before
