"""What a user runs, end to end through the command-line tools on CPU: a corpus of their own through
``zaya-preprocess``, training on it with evaluation, the next steps ``zaya-pretrain`` prints, the default Slurm
job's command line on a blend with its expert-load statistics, and a memory plan of a cluster's command."""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from zaya_cli import losses, pretrain

from megatron_zaya.data import embedded_tokenizer_dir
from megatron_zaya.data.embedded import EMBEDDED_CORPUS
from megatron_zaya.data.preprocess import write_indexed_dataset

import pytest

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = embedded_tokenizer_dir()
HF_TOKENIZER = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", TOKENIZER]
# Short sequences, small batches.
SMALL = ["--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr-warmup-iters", "1",
         "--log-interval", "1"]
# The test preset's shape with the embedded tokenizer's vocabulary.
TEST_MODEL = ["--zaya-preset", "test", "--zaya-vocab-size", "4096"]
VALIDATION = re.compile(r"validation loss at iteration\s+(\d+) .*?\| lm loss value: ([0-9.E+-]+)")
ITERATION_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*")
WANDB_RECORDER = Path(__file__).resolve().parents[1] / "wandb_recorder"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Chapters of the embedded corpus as a user's JSONL: ``first`` tokenised by the ``zaya-preprocess`` command,
    ``second`` by the same code in-process."""
    root = tmp_path_factory.mktemp("corpus")
    with gzip.open(EMBEDDED_CORPUS, "rt") as lines:
        chapters = lines.read().splitlines()
    (root / "first.jsonl").write_text("\n".join(chapters[:40]) + "\n")
    (root / "second.jsonl").write_text("\n".join(chapters[-40:]) + "\n")
    run = subprocess.run([sys.executable, "-m", "megatron_zaya.data.preprocess", "first.jsonl", "--output-prefix",
                          "first"], cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    write_indexed_dataset([str(root / "second.jsonl")], str(root / "second"), TOKENIZER, progress=False)
    return root


def validation_samples(prefix: Path, split: str, sizes: list[int]) -> list[dict]:
    """The validation split as Megatron's GPTDataset builds it for a run that asks for ``sizes`` samples (train,
    validation, test)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers import MegatronTokenizer

    tokenizer = MegatronTokenizer.from_pretrained(tokenizer_path=TOKENIZER, metadata_path={"library": "huggingface"})
    config = GPTDatasetConfig(random_seed=1234, sequence_length=64, blend=([str(prefix)], None), split=split,
                              tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, create_attention_mask=False)
    _, dataset, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    return [dataset[i] for i in range(sizes[1])]


def mean_loss(model, samples: list[dict]) -> float:
    """Mean cross-entropy per counted token, in float64 from the model's logits."""
    total = count = 0.0
    with torch.no_grad():
        for sample in samples:
            logits = model(sample["tokens"][None]).double()[0]
            per_token = torch.nn.functional.cross_entropy(logits, sample["labels"], reduction="none")
            total += (per_token * sample["loss_mask"]).sum().item()
            count += sample["loss_mask"].sum().item()
    return total / count


def printed(stdout: str, label: str) -> list[str]:
    (line,) = [line for line in stdout.splitlines() if line.strip().startswith(label)]
    return shlex.split(line.split(label, 1)[1])


def test_own_corpus_trains_evaluates_and_the_printed_next_steps_run(corpus, tmp_path):
    """One prefix from zaya-preprocess, evaluated at step 2, with the default preset (tiny) at 2 layers: the
    validation loss is the checkpoint's own loss on Megatron's validation samples. Then the two commands
    zaya-pretrain prints, with no venv on PATH: the continuation keeps the schedule that ended (lr stays at
    --min-lr) and takes --iterations-to-skip (which the non-finite-step guard suggests), and the export carries
    the tokenizer."""
    ckpt = tmp_path / "ckpt"
    flags = SMALL + ["--num-layers", "2", "--data-path", str(corpus / "first"), *HF_TOKENIZER, "--split", "90,10,0",
                     "--lr", "1e-3", "--min-lr", "1e-4", "--train-iters", "2", "--eval-interval", "2", "--eval-iters",
                     "2", "--save", str(ckpt), "--save-interval", "2"]
    run = pretrain(flags, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(losses(run.stdout)) == [1, 2]
    # Step 2's evaluation, then the one at the end of training: each reads the next eval-iters x global batch
    # samples of the validation split, of which Megatron builds (2 // eval-interval + 1) x that many.
    evaluations = VALIDATION.findall(run.stdout)
    assert [iteration for iteration, _ in evaluations] == ["2", "2"]

    from megatron_zaya import load_pretrained

    samples = validation_samples(corpus / "first", "90,10,0", sizes=[2 * 4, 2 * 2 * 4, 2 * 4])
    model = load_pretrained(ckpt, device="cpu")
    assert (model.config.num_layers, model.config.hidden_size) == (2, 128)  # --num-layers over tiny's shape
    for (_, value), batch in zip(evaluations, (samples[:8], samples[8:]), strict=True):
        expected = mean_loss(model, batch)
        assert abs(float(value) - expected) <= 2e-6 * expected, (value, expected)  # printed to 7 digits

    continued = printed(run.stdout, "continue training:")
    exported = printed(run.stdout, "convert to Hugging Face:")
    assert continued[:3] == [sys.executable, "-m", "megatron_zaya.pretrain"] and Path(sys.executable).is_absolute()
    assert exported[:2] == [sys.executable, "-m"]
    assert exported[2:] == ["megatron_zaya.convert.cli", "export-hf", str(ckpt), f"{ckpt}-hf", "--tokenizer", TOKENIZER]

    env = {**os.environ, "PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1"}
    resumed = subprocess.run(continued + ["--iterations-to-skip", "3"], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"successfully loaded checkpoint from {ckpt}" in resumed.stdout
    assert sorted(losses(resumed.stdout)) == [4]  # 3 skipped: its batch is passed over, not trained
    (line,) = [m.group(0) for m in ITERATION_LINE.finditer(resumed.stdout)]
    assert "consumed samples:           16 |" in line and "learning rate: 1.000000E-04 |" in line, line

    from megatron_zaya.convert.cli import main as convert

    assert convert(exported[3:]) == 0
    assert (Path(f"{ckpt}-hf") / "tokenizer.json").is_file()


def slurm_job_flags(tmp_path: Path, data: str) -> list[str]:
    """The zaya-pretrain flags of examples/slurm/pretrain_zaya1_8b.sbatch at its defaults (zaya_muon, bf16,
    the distributed optimizer, TensorBoard, evaluation), read from the torchrun line it starts under fake Slurm."""
    records = tmp_path / "records"
    records.mkdir()
    env = {"PATH": f"{REPO / 'tests/unit/launch_fakebin'}:{Path(sys.executable).parent}:/usr/bin:/bin",
           "HOME": str(tmp_path), "FAKE_SLURM_RECORDS": str(records), "FAKE_SLURM_HOSTS": "node1",
           "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "node1", "SLURM_CPUS_ON_NODE": "2",
           "SLURM_SUBMIT_DIR": str(REPO), "ZAYA_PLATFORM": "h200", "RUN_DIR": str(tmp_path / "run"),
           "DATA_PATH": data, "TOKENIZER": TOKENIZER, "CONTAINER_RUNTIME": "none"}
    job = subprocess.run(["bash", str(REPO / "examples/slurm/pretrain_zaya1_8b.sbatch")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert job.returncode == 0, job.stderr
    (record,) = records.glob("*-torchrun-*.json")
    argv = json.loads(record.read_text())["argv"]
    shutil.rmtree(tmp_path / "run")  # what the fake training step wrote
    return argv[argv.index("zaya-pretrain") + 1:]


def test_the_default_slurm_job_trains_a_blend_on_cpu_and_logs_the_expert_load(corpus, tmp_path):
    """The sbatch's command line, with the test model and two steps appended, on 2 gloo ranks (ZeRO-1 Muon) on
    a blend of two prefixes with --eval-iters 0. Every layer's expert load and the experts' gradient norm
    (--zaya-expert-clip-grad) reach W&B each step (a recorder stands in for the wandb package); the bias range is
    the checkpoint's balancing biases."""
    flags = slurm_job_flags(tmp_path, f"0.7 {corpus / 'first'} 0.3 {corpus / 'second'}")
    assert flags[flags.index("--optimizer") + 1] == "zaya_muon" and "--bf16" in flags
    record = tmp_path / "wandb.jsonl"
    env = {"PYTHONPATH": os.pathsep.join([str(WANDB_RECORDER), os.environ.get("PYTHONPATH", "")]),
           "ZAYA_WANDB_RECORD": str(record)}
    run = pretrain(flags + TEST_MODEL + SMALL + ["--train-iters", "2", "--eval-iters", "0", "--split", "98,2,0",
                                    "--save-interval", "2", "--wandb-project", "zaya", "--wandb-exp-name", "cpu",
                                    "--zaya-expert-clip-grad", "1.0"],
                   cwd=tmp_path, extra_env=env, nproc=2)
    assert run.returncode == 0, run.stderr[-3000:]
    trained = losses(run.stdout)
    assert sorted(trained) == [1, 2] and all(math.isfinite(v) for v in trained.values())

    logged = {}
    for line in record.read_text().splitlines():
        entry = json.loads(line)
        step = entry.pop("step")
        logged.update({(step, key): value for key, value in entry.items() if key.startswith("zaya/")})
    statistics = ("max_share", "min_share", "skip_rate", "bias_min", "bias_max")
    assert set(logged) == {(step, f"zaya/layer{layer:02d}/{name}") for step in (1, 2) for layer in (1, 2)
                           for name in statistics} | {(step, "zaya/expert_grad_norm") for step in (1, 2)}
    assert all(logged[step, "zaya/expert_grad_norm"] > 0 for step in (1, 2))
    for step, key in logged:
        if key.endswith("max_share"):
            assert logged[step, key] >= 1 / 4 >= logged[step, key.replace("max", "min")]

    state_file = tmp_path / "step2.pt"
    dcp_to_torch_save(tmp_path / "run/checkpoints/iter_0000002", state_file)
    state = torch.load(state_file, weights_only=False)
    for layer in (1, 2):
        biases = state["decoder.layers.mlp.router.balancing_biases"][layer - 1, :4]  # the skip class's is last
        assert logged[2, f"zaya/layer{layer:02d}/bias_min"] == biases.min().item()
        assert logged[2, f"zaya/layer{layer:02d}/bias_max"] == biases.max().item()
