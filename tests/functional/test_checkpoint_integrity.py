"""Damaged checkpoints on disk: flipped bytes, truncated shards, garbage metadata and trackers. A run resumes
from the newest intact checkpoint (named in one line) or stops with exit 2; a conversion refuses a damaged one; no
file of any checkpoint changes. And checkpoints that do not fit the run: another model, optimizer or tokenizer."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil

import pytest
from shared import once
from zaya_cli import QUICK, losses, pretrain

from megatron_zaya.checkpoint import CHECKSUMS, TRACKER, damage, newest_intact_checkpoint, recorded_files
from megatron_zaya.convert.cli import main as convert
from megatron_zaya.data import embedded_tokenizer_dir
from megatron_zaya.errors import UsageError

SHARD = "__0_0.distcp"
FLAGS = QUICK + ["--train-iters", "4", "--save-interval", "2"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints 2 and 4 of a 4-step run (one run for every worker: read-only, copy to damage), and its losses."""

    def train(directory):
        run = pretrain(FLAGS + ["--save", "ck", "--load", "ck"], cwd=directory)
        assert run.returncode == 0, run.stderr[-3000:]
        (directory / "stdout.log").write_text(run.stdout)

    directory = once(tmp_path_factory, "saved-4-steps", train)
    return directory / "ck", losses((directory / "stdout.log").read_text())


def _copy(saved, tmp_path):
    ckpt = tmp_path / "ck"
    shutil.copytree(saved[0], ckpt)
    return ckpt


def _hashes(ckpt):
    """Every file of every checkpoint, and the tracker (not the run's logs beside them)."""
    return {str(p.relative_to(ckpt)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(ckpt.rglob("*")) if p.is_file() and (p.name == TRACKER or p.parent != ckpt)}


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset:offset + 8] = bytes(b ^ 0xFF for b in data[offset:offset + 8])
    path.write_bytes(bytes(data))


def _truncate(path):
    """Cut the file to 4 KiB (an interrupted copy, a full disk): what follows, the checkpoint's common state
    included, is gone."""
    path.write_bytes(path.read_bytes()[:4096])


DAMAGE = {  # what is done to the copy -> the checkpoint a resume must choose
    "bytes flipped in the newest shard": (lambda ck: _flip(ck / "iter_0000004" / SHARD, 1 << 20), "2"),
    "newest shard truncated": (lambda ck: _truncate(ck / "iter_0000004" / SHARD), "2"),
    "garbage .metadata": (lambda ck: (ck / "iter_0000004" / ".metadata").write_bytes(b"\x80garbage" * 64), "2"),
    "garbage metadata.json": (lambda ck: (ck / "iter_0000004" / "metadata.json").write_text("{not json"), "2"),
    "newest step directory gone": (lambda ck: shutil.rmtree(ck / "iter_0000004"), "2"),
    "empty tracker": (lambda ck: (ck / TRACKER).write_text(""), "4"),
    "garbage tracker": (lambda ck: (ck / TRACKER).write_bytes(b"\x00\xff4x"), "4"),
    "garbage tracker and flipped bytes": (lambda ck: ((ck / TRACKER).write_text("four"),
                                                      _flip(ck / "iter_0000004" / SHARD, 4096)), "2"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_the_newest_intact_checkpoint_is_chosen(case, saved, tmp_path, capsys):
    ckpt = _copy(saved, tmp_path)
    spoil, expected = DAMAGE[case]
    spoil(ckpt)
    before = _hashes(ckpt)
    assert newest_intact_checkpoint(str(ckpt)) == expected
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith("zaya-pretrain: warning:"), warning
    assert f"loading the newest intact checkpoint, {ckpt}/iter_000000{expected}" in warning[0], warning
    assert _hashes(ckpt) == before


def test_an_intact_checkpoint_loads_quietly(saved, capsys):
    assert newest_intact_checkpoint(str(saved[0])) == "4"
    assert capsys.readouterr().err == ""


def test_every_file_of_a_save_is_recorded(saved):
    step = saved[0] / "iter_0000004"
    recorded = recorded_files(step)
    assert sorted(recorded) == sorted(p.name for p in step.iterdir() if p.name != CHECKSUMS)
    assert damage(step, list(recorded), recorded) == []


def test_none_intact_is_refused_in_one_line(saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    _truncate(ckpt / "iter_0000004" / SHARD)
    _flip(ckpt / "iter_0000002" / SHARD, 1 << 20)
    before = _hashes(ckpt)
    with pytest.raises(UsageError, match="no intact checkpoint in --load") as error:
        newest_intact_checkpoint(str(ckpt))
    assert f"{ckpt}/iter_0000004 ({SHARD} has " in str(error.value)
    assert f"{ckpt}/iter_0000002 ({SHARD} differs from its checksum at save)" in str(error.value)
    assert _hashes(ckpt) == before


def test_a_run_resumes_past_a_damaged_checkpoint_and_saves_a_verified_one(saved, tmp_path):
    """Flipped bytes in the newest shard and a garbage tracker: the run loads 2, repeats steps 3 and 4 with the
    losses of the run that saved them, and its save of 4 is intact; checkpoint 2 is untouched."""
    ckpt = _copy(saved, tmp_path)
    (ckpt / TRACKER).write_text("garbage")
    _flip(ckpt / "iter_0000004" / SHARD, 1 << 20)
    kept = {k: v for k, v in _hashes(ckpt).items() if k.startswith("iter_0000002")}
    run = pretrain(FLAGS + ["--save", "ck", "--load", "ck"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    warnings = [line for line in run.stderr.splitlines() if line.startswith("zaya-pretrain: warning:")]
    assert len(warnings) == 1 and f"ck/iter_0000004 ({SHARD} differs" in warnings[0], warnings
    assert "Traceback" not in run.stderr
    # A quiet start: one line for the optional packages, the argument dump and patch lines in the run directory.
    assert "not installed" not in run.stderr and run.stdout.count("[zaya] not installed: ") == 1
    assert "------------------------ arguments" not in run.stdout and "[zaya-patches]" not in run.stdout
    assert "patches applied; the argument dump and patch lines: ck/zaya-start.log" in run.stdout
    start_log = (ckpt / "zaya-start.log").read_text()
    assert "------------------------ arguments" in start_log and "reliability.verified_load" in start_log
    resumed = losses(run.stdout)
    assert sorted(resumed) == [3, 4] and all(resumed[i] == saved[1][i] for i in (3, 4)), (resumed, saved[1])
    curve = [line.split(",") for line in (ckpt / "loss.csv").read_text().splitlines()[1:]]
    assert [int(i) for i, _ in curve] == [1, 2, 3, 4]  # the first run's steps 1-2, then this run's
    assert all(abs(float(v) - resumed[int(i)]) < 1e-5 * resumed[int(i)] for i, v in curve[2:]), curve
    assert (ckpt / TRACKER).read_text() == "4"
    assert newest_intact_checkpoint(str(ckpt)) == "4"
    assert {k: v for k, v in _hashes(ckpt).items() if k.startswith("iter_0000002")} == kept
    # The event ledger: the damage found while the run was down, what it cost, and the resume past it.
    events = [json.loads(line) for line in (ckpt / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["start", "end", "checkpoint_skipped", "start", "end"], events
    skipped = events[2]
    assert skipped["step"] == 2 and skipped["steps_lost"] == 2 and skipped["rank"] == 0, skipped
    assert f"ck/iter_0000004 ({SHARD} differs from its checksum at save)" in skipped["cause"], skipped
    assert events[3]["step"] == 3 and events[3]["cause"] == "resumed at step 3", events[3]
    assert "damaged checkpoints skipped 1, nodes excluded 0; lost to faults: steps 2, seconds 0\n" in run.stdout


def test_a_run_with_no_intact_checkpoint_exits_2_and_changes_nothing(saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    _truncate(ckpt / "iter_0000004" / SHARD)
    (ckpt / "iter_0000002" / "metadata.json").write_text("garbage")
    before = _hashes(ckpt)
    run = pretrain(FLAGS + ["--save", "ck", "--load", "ck"], cwd=tmp_path)
    assert run.returncode == 2, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("zaya-pretrain: error: no intact checkpoint in --load ck:"), last
    assert "iter_0000004" in last and "iter_0000002 (metadata.json has" in last, last
    assert "Traceback" not in run.stderr
    assert _hashes(ckpt) == before


def test_raising_train_iters_on_a_finished_run_is_one_line(saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    before = _hashes(ckpt)
    run = pretrain(QUICK + ["--train-iters", "8", "--save-interval", "2", "--save", "ck", "--load", "ck"],
                   cwd=tmp_path)
    assert run.returncode == 2, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("zaya-pretrain: error: the checkpoint's schedule has total number of iterations 32, "
                           "this run's flags give 64"), last
    assert "--override-opt_param-scheduler" in last and "Traceback" not in run.stderr
    assert _hashes(ckpt) == before


def test_the_suggested_override_continues_on_this_runs_schedule(saved, tmp_path):
    """What the refusal above suggests: with --override-opt_param-scheduler the finished 4-step run trains on to
    step 8 on an 8-step schedule (warm-up 2, cosine from 3e-3 to 3e-4), not on the finished one's last rate."""
    ckpt = _copy(saved, tmp_path)
    run = pretrain(QUICK + ["--train-iters", "8", "--save-interval", "2", "--save", "ck", "--load", "ck",
                            "--override-opt_param-scheduler"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rates = {int(i): float(lr) for i, lr in re.findall(r"iteration\s+(\d+)/.*?learning rate: ([0-9.E+-]+)", run.stdout)}
    expected = {i: 3e-4 + (3e-3 - 3e-4) * 0.5 * (1 + math.cos(math.pi * (i - 2) / 6)) for i in range(5, 9)}
    assert rates == pytest.approx(expected, rel=1e-6), rates
    assert (ckpt / TRACKER).read_text().strip() == "8"


def test_a_damaged_checkpoint_is_not_exported(saved, tmp_path, capsys):
    ckpt = _copy(saved, tmp_path)
    _flip(ckpt / "iter_0000004" / SHARD, 1 << 20)
    before = _hashes(ckpt)
    assert convert(["export-hf", str(ckpt), str(tmp_path / "hf")]) == 2
    error = capsys.readouterr().err.strip()
    assert error == (f"zaya-convert: error: {ckpt}/iter_0000004 is damaged ({SHARD} differs from its checksum at "
                     f"save); restore it from a copy, or write 2 into {ckpt}/{TRACKER} to take the newest intact one")
    assert not (tmp_path / "hf").exists() and _hashes(ckpt) == before


def _reordered_tokenizer(directory):
    """The embedded tokenizer with the ids of its last two tokens swapped: the same size, other ids."""
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{embedded_tokenizer_dir()}/{name}", directory / name)
    spec = json.loads((directory / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    last, before_last = (next(t for t, i in vocab.items() if i == n) for n in (4095, 4094))
    vocab[last], vocab[before_last] = 4094, 4095
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    return directory


def test_a_checkpoint_of_another_model_optimizer_and_tokenizer_is_refused_in_one_line(saved, tmp_path):
    """Resuming Adam's checkpoint with zaya_muon, another tokenizer and other model flags: one line naming each
    mismatch and its fix, exit 2, before training (it was a shape error, a traceback about param_groups, and a
    silent change of what the token ids mean); every checkpoint file unchanged."""
    ckpt = _copy(saved, tmp_path)
    before = _hashes(ckpt)
    tokenizer = _reordered_tokenizer(tmp_path / "tokenizer")
    run = pretrain(FLAGS + ["--save", "ck", "--load", "ck", "--optimizer", "zaya_muon", "--tokenizer-model",
                            str(tokenizer), "--zaya-preset", "tiny", "--num-layers", "2", "--zaya-cca-time0", "3"],
                   cwd=tmp_path)
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and " iteration " not in run.stdout
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("zaya-pretrain: error: --load ck: it holds a different model ("), last
    assert "--num-layers: 4 in the checkpoint, 2 here" in last, last  # named by the flags that set them
    assert "--zaya-cca-time0: 2 in the checkpoint, 3 here" in last, last
    assert ("it holds the state of --optimizer adam, but this run uses --optimizer zaya_muon; add --no-load-optim "
            "to start zaya_muon afresh") in last, last
    assert f"it was trained with another tokenizer ({embedded_tokenizer_dir()}, 4096 tokens, digest " in last, last
    assert f"this run's: {tokenizer}, 4096 tokens, digest " in last and "--zaya-allow-tokenizer-change" in last, last
    assert _hashes(ckpt) == before


def test_past_a_cut_shard_with_a_fresh_optimizer_and_another_tokenizer(saved, tmp_path):
    """The newest checkpoint's shard cut short (the common state gone with it): the run resumes from checkpoint 2,
    named in one warning (it failed reading that shard before choosing). With --no-load-optim and
    --zaya-allow-tokenizer-change it trains zaya_muon from checkpoint 2's weights: step 3's loss, computed before
    any update by the new optimizer, is the one of the Adam run that saved the checkpoint."""
    ckpt = _copy(saved, tmp_path)
    _truncate(ckpt / "iter_0000004" / SHARD)
    tokenizer = _reordered_tokenizer(tmp_path / "tokenizer")
    run = pretrain(FLAGS + ["--save", "ck", "--load", "ck", "--optimizer", "zaya_muon", "--no-load-optim",
                            "--tokenizer-model", str(tokenizer), "--zaya-allow-tokenizer-change"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    warnings = [line for line in run.stderr.splitlines() if line.startswith("zaya-pretrain: warning:")]
    size = (saved[0] / "iter_0000004" / SHARD).stat().st_size
    assert warnings == [f"zaya-pretrain: warning: ck/iter_0000004 ({SHARD} has 4096 bytes, {size} when saved): "
                        "damaged; loading the newest intact checkpoint, ck/iter_0000002 (iteration 2)"], warnings
    resumed = losses(run.stdout)
    assert sorted(resumed) == [3, 4] and resumed[3] == saved[1][3], (resumed, saved[1])
