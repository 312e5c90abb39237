"""Megatron's stock ``pretrain()`` trains a tiny GPT-MoE on CPU with gloo, behind the ``startup`` and ``cpu`` patches.

The model has 2 layers (RMSNorm, RoPE, SwiGLU, dropout 0.1), the second one MoE. Each run launches
``benchmarks/gpt_pretrain.py`` (a cut-down ``pretrain_gpt.py``) under torchrun with ``--mock-data`` and the
NullTokenizer; the entry records every micro-batch loss exactly (``GPT_PRETRAIN_LOSSES``). Checked
against independent references:

* one rank, 10 iterations: the first loss is ln(vocab) (an untrained model), and the loss falls;
* a run resumed from the iteration-5 ``torch_dist`` checkpoint gives the uninterrupted run's losses for
  iterations 6-10, bit for bit (with dropout on: the RNG state round-trips through the checkpoint).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from shared import once

ENTRY = Path(__file__).parents[2] / "benchmarks" / "gpt_pretrain.py"
VOCAB = 128
MODEL = (
    "--transformer-impl local --num-layers 2 --hidden-size 32 --num-attention-heads 4 --ffn-hidden-size 64 "
    "--seq-length 32 --max-position-embeddings 32 --normalization RMSNorm --swiglu --position-embedding-type rope "
    "--disable-bias-linear --untie-embeddings-and-output-weights --attention-dropout 0.1 --hidden-dropout 0.1 "
    "--use-cpu-initialization --no-gradient-accumulation-fusion --no-rope-fusion --no-persist-layer-norm "
    "--no-masked-softmax-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion "
    # the second layer is MoE: 4 SequentialMLP experts, top-2, alltoall dispatcher, aux loss
    "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-token-dispatcher-type alltoall "
    "--moe-aux-loss-coeff 1e-2 --moe-layer-freq ([0]+[1])"
)
TRAINING = (
    f"--distributed-backend gloo --mock-data --tokenizer-type NullTokenizer --vocab-size {VOCAB} --split 100,0,0 "
    "--micro-batch-size 2 --global-batch-size 4 --train-iters 10 --lr 1e-2 --lr-decay-style constant "
    "--seed 1234 --eval-iters 0 --eval-interval 1000 --log-interval 1 --ckpt-format torch_dist"
)


def pretrain(tmp: Path, name: str, extra: str = "") -> None:
    """Run the entry on one gloo process, its losses recorded in ``<tmp>/<name>.rank0.jsonl``."""
    record = tmp / name
    env = os.environ | {
        "GPT_PRETRAIN_LOSSES": str(record),
        "ZAYA_PATCHES": "startup,cpu",
        "OMP_NUM_THREADS": "1",  # same kernels in every run: bit-exact comparisons
    }
    # --standalone: torchrun's own rendezvous picks the port (a port found free here could be taken by a test
    # running beside this one before the rank listens on it)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", str(ENTRY),
               *f"{MODEL} {TRAINING} {extra}".split()]  # fmt: skip
    run = subprocess.run(command, env=env, cwd=tmp, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{name} failed:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"


def recorded(tmp: Path, name: str) -> dict[int, list[float]]:
    """``{iteration: [loss sums of its micro-batches]}`` of the run ``name``."""
    losses: dict[int, list[float]] = {}
    for line in Path(f"{tmp / name}.rank0.jsonl").read_text().splitlines():
        entry = json.loads(line)
        assert entry["tokens"] == 2 * 32, entry
        losses.setdefault(entry["iteration"], []).append(entry["loss_sum"])
    return losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted run and the one resumed from its checkpoint 5 (run once for every worker)."""

    def train(tmp):
        pretrain(tmp, "one_rank", extra=f"--save {tmp / 'checkpoints'} --save-interval 5")
        pretrain(tmp, "resumed", extra=f"--load {tmp / 'checkpoints'} --ckpt-step 5")

    tmp = once(tmp_path_factory, "cpu-pretrain-gpt", train)
    return {name: recorded(tmp, name) for name in ("one_rank", "resumed")}


def mean_token_loss(losses: dict[int, list[float]], iteration: int) -> float:
    return sum(losses[iteration]) / (2 * 2 * 32)


def test_untrained_loss_is_uniform_and_training_lowers_it(runs):
    losses = runs["one_rank"]
    assert sorted(losses) == list(range(1, 11)) and all(len(mbs) == 2 for mbs in losses.values())
    assert mean_token_loss(losses, 1) == pytest.approx(math.log(VOCAB), abs=0.1)
    assert mean_token_loss(losses, 10) < mean_token_loss(losses, 1) - 1.0


def test_resume_from_checkpoint_matches_uninterrupted_run_bit_for_bit(runs):
    uninterrupted, resumed = runs["one_rank"], runs["resumed"]
    assert sorted(resumed) == list(range(6, 11))
    assert resumed == {iteration: uninterrupted[iteration] for iteration in range(6, 11)}
