"""zaya-convert and load_pretrained: bit-identical round trips, the transformers oracle, and bad input."""

from __future__ import annotations

import json
import resource
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from zaya_reference import hf_config, random_hf_model

from megatron_zaya import load_pretrained
from megatron_zaya.convert.cli import main as convert


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "zaya-small"
    config = hf_config(num_hidden_layers=2, sliding_window=4, layer_types=["hybrid_sliding", "hybrid"])
    random_hf_model(config, seed=11).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def megatron_dir(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("meg") / "ckpt"
    assert convert(["import-hf", str(hf_dir), str(out)]) == 0
    return out


def reference_logits(path, ids):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(ids).logits


IDS = torch.randint(0, 384, (2, 9), generator=torch.Generator().manual_seed(0))


def test_round_trip_is_bit_identical(hf_dir, megatron_dir, tmp_path):
    out = tmp_path / "hf-again"
    assert convert(["export-hf", str(megatron_dir), str(out)]) == 0
    before, after = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(before) == set(after)
    for key, tensor in before.items():
        assert tensor.dtype == after[key].dtype and torch.equal(tensor, after[key]), key
    assert torch.equal(reference_logits(hf_dir, IDS), reference_logits(out, IDS))


@pytest.mark.parametrize("source", ["hf", "megatron"])
def test_load_pretrained_matches_transformers(source, hf_dir, megatron_dir):
    model = load_pretrained(hf_dir if source == "hf" else megatron_dir)
    with torch.no_grad():
        logits = model(IDS)
    ref = reference_logits(hf_dir, IDS)
    assert logits.shape == ref.shape
    assert ((logits - ref).abs().max() / ref.abs().max()).item() <= 1e-5


def _expect_error(capsys, argv, words, out):
    assert convert(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("zaya-convert: error:") and "\n" not in err and all(w in err for w in words), err
    assert not out.exists() or out.name == "occupied"


def test_not_a_zaya_checkpoint(hf_dir, tmp_path, capsys):
    bad = tmp_path / "llama"
    shutil.copytree(hf_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    _expect_error(capsys, ["import-hf", str(bad), str(tmp_path / "o")], ["model_type", "llama"], tmp_path / "o")


def test_missing_files(hf_dir, tmp_path, capsys):
    bad = tmp_path / "noweights"
    bad.mkdir()
    shutil.copy(hf_dir / "config.json", bad / "config.json")
    _expect_error(capsys, ["import-hf", str(bad), str(tmp_path / "o")], ["model.safetensors"], tmp_path / "o")
    _expect_error(capsys, ["import-hf", str(tmp_path / "nowhere"), str(tmp_path / "o")], ["config.json"],
                  tmp_path / "o")
    _expect_error(capsys, ["export-hf", str(bad), str(tmp_path / "o")], ["latest_checkpointed_iteration"],
                  tmp_path / "o")


def test_shape_mismatch(hf_dir, tmp_path, capsys):
    bad = tmp_path / "wrongshape"
    shutil.copytree(hf_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 32}))
    _expect_error(capsys, ["import-hf", str(bad), str(tmp_path / "o")], ["shape"], tmp_path / "o")


def test_existing_output_is_never_overwritten(hf_dir, megatron_dir, tmp_path, capsys):
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("precious")
    _expect_error(capsys, ["import-hf", str(hf_dir), str(occupied)], ["not empty"], occupied)
    _expect_error(capsys, ["export-hf", str(megatron_dir), str(occupied)], ["not empty"], occupied)
    assert [p.name for p in occupied.iterdir()] == ["keep.txt"]


def test_an_output_that_cannot_be_written_is_refused_before_the_model_loads(hf_dir, megatron_dir, tmp_path, capsys):
    """Below a regular file, or in /proc (which takes no new files, though os.access says it does to root): one line,
    exit 2, and no directory made on the way (missing parents are made only when the output is published)."""
    (tmp_path / "a-file").write_text("")
    for out in (tmp_path / "a-file" / "o", "/proc/zaya-o"):
        _expect_error(capsys, ["import-hf", str(hf_dir), str(out)], [f"output {out} cannot be written"],
                      tmp_path / "o")
        _expect_error(capsys, ["export-hf", str(megatron_dir), str(out)], [f"output {out} cannot be written"],
                      tmp_path / "o")
    _expect_error(capsys, ["export-hf", str(tmp_path / "nowhere"), str(tmp_path / "new" / "o")],
                  ["latest_checkpointed_iteration"], tmp_path / "o")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.parametrize("command", ["export-hf", "import-hf"])
def test_a_disk_that_fills_during_a_conversion_leaves_nothing(command, hf_dir, megatron_dir, tmp_path):
    """The output's largest file (the safetensors file; the torch_dist shard, written by Megatron's writer threads)
    outgrows the file-size limit (RLIMIT_FSIZE, as a full disk fails a write): one line, exit 2, and no output or
    staging directory is left."""

    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))

    source = megatron_dir if command == "export-hf" else hf_dir
    run = subprocess.run([sys.executable, "-m", "megatron_zaya.convert.cli", command, str(source), "out"],
                         cwd=tmp_path, preexec_fn=limited, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("zaya-convert: error: writing out failed (") and "File too large" in last, last
    assert "Traceback" not in run.stderr and list(tmp_path.iterdir()) == []


def test_broken_checkpoint_tracker(megatron_dir, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(megatron_dir, broken)
    (broken / "latest_checkpointed_iteration.txt").write_text("100")
    _expect_error(capsys, ["export-hf", str(broken), str(tmp_path / "o")], ["iter_0000100"], tmp_path / "o")


def _spoil(ckpt, how):
    """Flip 8 bytes in the middle of the (only) shard of a copy's step, or cut it to 4 KiB (an interrupted copy)."""
    shard = next(ckpt.glob("*/__0_0.distcp"))
    data = bytearray(shard.read_bytes())
    if how == "flipped":
        middle = len(data) // 2
        data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    else:
        del data[4096:]
    shard.write_bytes(bytes(data))
    return shard


def test_a_damaged_checkpoint_is_not_exported(megatron_dir, tmp_path, capsys):
    damaged = tmp_path / "damaged"
    shutil.copytree(megatron_dir, damaged)
    _spoil(damaged, "flipped")
    _expect_error(capsys, ["export-hf", str(damaged), str(tmp_path / "o")],
                  [f"{damaged}/release is damaged (__0_0.distcp differs from its checksum at save)", "from a copy"],
                  tmp_path / "o")


LOAD_IN_A_NEW_PROCESS = """
import sys, torch
from megatron_zaya import load_pretrained
from megatron_zaya.errors import CheckpointError
tensor_cuda, current_device = torch.Tensor.cuda, torch.cuda.current_device
model = load_pretrained(sys.argv[1])
assert torch.Tensor.cuda is tensor_cuda and torch.cuda.current_device is current_device, "torch was patched"
with torch.no_grad():
    torch.save(model(torch.load(sys.argv[2])), sys.argv[3])
try:
    load_pretrained(sys.argv[4])
except CheckpointError as error:
    print(error)
"""


def test_load_pretrained_leaves_torch_as_it_was_and_refuses_a_damaged_checkpoint(hf_dir, megatron_dir, tmp_path):
    """In a process of its own (the tests before it may have patched torch): on a CPU-only machine,
    ``torch.Tensor.cuda`` and ``torch.cuda.current_device`` are the same objects after ``load_pretrained`` (they
    were replaced for the whole process), the model's logits still match transformers', and a checkpoint whose
    shard was cut short is refused (it was read until Megatron's loader failed)."""
    damaged = tmp_path / "damaged"
    shutil.copytree(megatron_dir, damaged)
    shard = _spoil(damaged, "cut")
    torch.save(IDS, tmp_path / "ids.pt")
    run = subprocess.run([sys.executable, "-c", LOAD_IN_A_NEW_PROCESS, str(megatron_dir), str(tmp_path / "ids.pt"),
                          str(tmp_path / "logits.pt"), str(damaged)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    logits, ref = torch.load(tmp_path / "logits.pt"), reference_logits(hf_dir, IDS)
    assert ((logits - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    saved = (megatron_dir / "release" / shard.name).stat().st_size
    assert run.stdout.strip().splitlines()[-1] == (f"{damaged}/release is damaged ({shard.name} has 4096 bytes, "
                                                   f"{saved} when saved); restore it from a copy"), run.stdout


def test_console_script_exit_code(tmp_path):
    """The installed entry point exits 2 with a single line on bad input."""
    result = subprocess.run([sys.executable, "-m", "megatron_zaya.convert.cli", "import-hf", str(tmp_path / "x"),
                             str(tmp_path / "y")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("zaya-convert: error:")
