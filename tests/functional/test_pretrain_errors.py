"""zaya-pretrain on bad input next to a checkpoint: the checkpoint is left as it was (the one-line errors of bad
flags are checked in ``test_bad_input.py``)."""

from __future__ import annotations

from zaya_cli import QUICK, pretrain


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
