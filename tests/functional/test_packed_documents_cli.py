"""Packed documents through the CLI (``--reset-position-ids --reset-attention-mask --eod-mask-loss``): the loss
zaya-pretrain logs equals the loss of one document run on its own, in float64, with the run's initial weights.

Every document of the corpus is the same 15 random tokens and an EOD, and 16 divides the sequence length, so
every sample the loader cuts (at multiples of the sequence length, whatever its shuffling) is that document
4 times over. With the learning rates 0 the weights stay the initial ones, which the checkpoint then holds.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoTokenizer
from zaya_cli import QUICK, losses, pretrain

from megatron_zaya import load_pretrained
from megatron_zaya.data import embedded_tokenizer_dir

SEQ, DOC = 64, 16
TOLERANCE = 2e-6  # relative
TOKENIZER = AutoTokenizer.from_pretrained(embedded_tokenizer_dir())
EOD = TOKENIZER.eos_token_id  # Megatron's .eod for this tokenizer


def _corpus(prefix: str, document: list[int], copies: int) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for _ in range(copies):
        builder.add_document(torch.tensor(document + [EOD]), [DOC])
    builder.finalize(prefix + ".idx")


def _loss(model, tokens: list[int], labels: list[int]) -> float:
    logits = model(torch.tensor([tokens])).double()
    return torch.nn.functional.cross_entropy(logits[0], torch.tensor(labels)).item()


def test_packed_documents_train_each_document_as_if_alone(tmp_path):
    document = (torch.randint(EOD + 1, len(TOKENIZER), (DOC - 1,), generator=torch.Generator().manual_seed(7))).tolist()
    prefix = str(tmp_path / "docs")
    _corpus(prefix, document, copies=200)
    ckpt = tmp_path / "ckpt"
    run = pretrain(QUICK + ["--train-iters", "2", "--lr", "0", "--min-lr", "0", "--lr-warmup-iters", "0",
                            "--zaya-balancing-lr", "0", "--data-path", prefix, "--split", "100,0,0",
                            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", embedded_tokenizer_dir(),
                            "--save", str(ckpt), "--save-interval", "2",
                            "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    logged = losses(run.stdout)
    assert sorted(logged) == [1, 2], run.stdout[-3000:]

    model = load_pretrained(ckpt).double()
    with torch.no_grad():
        # One document alone: its tokens predict the next ones and the EOD (the EOD's own prediction is masked).
        alone = _loss(model, document, document[1:] + [EOD])
        # The same tokens as one causal sequence: later documents see the earlier ones.
        packed = (document + [EOD]) * (SEQ // DOC) + document[:1]
        kept = [i for i in range(SEQ) if packed[i] != EOD]
        logits = model(torch.tensor([packed[:SEQ]])).double()[0]
        causal = torch.nn.functional.cross_entropy(logits[kept], torch.tensor(packed[1:])[kept]).item()
    for iteration in (1, 2):  # the logged loss has 7 digits
        assert abs(logged[iteration] - alone) <= TOLERANCE * alone, (logged, alone)
    assert abs(causal - alone) > 50 * TOLERANCE * alone, (causal, alone)  # the comparison tells packing from none
