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


def test_checkpoint_of_another_architecture_is_refused(tmp_path):
    """Resuming with different model flags names the differing flags instead of failing on shapes."""
    save = tmp_path / "ckpt"
    first = pretrain(QUICK + ["--train-iters", "3", "--save", str(save), "--load", str(save)], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    before = {p: p.read_bytes() for p in save.rglob("*") if p.is_file()}
    run = pretrain(QUICK + ["--train-iters", "4", "--save", str(save), "--load", str(save), "--zaya-preset", "tiny", "--num-layers", "2",
                            "--zaya-cca-time0", "3"], cwd=tmp_path)
    assert run.returncode == 2
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("zaya-pretrain: error:") and "--num-layers: 4 in the checkpoint, 2 here" in last, last
    assert "--zaya-cca-time0: 2 in the checkpoint, 3 here" in last
    assert {p: p.read_bytes() for p in save.rglob("*") if p.is_file()} == before
