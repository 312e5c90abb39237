"""A tokenizer of the generic fast class read with the ``tokenizers`` library alone (data/tokenizer_json.py): the
same ids as transformers' tokenizer, the same vocabulary, special tokens and checkpoint identity as Megatron's
``HuggingFaceTokenizer``; Megatron builds it without importing transformers (the ``startup.tokenizer_json``
patch); a tokenizer of another class, or with a chat template, still goes through transformers."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron_zaya.checkpoint.fits import tokenizer_identity
from megatron_zaya.data.embedded import EMBEDDED_CORPUS, EMBEDDED_DIR
from megatron_zaya.data.preprocess import load_tokenizer
from megatron_zaya.data.tokenizer_json import TokenizerJson

with gzip.open(EMBEDDED_CORPUS, "rt", encoding="utf-8") as _corpus:
    TEXTS = [json.loads(line)["text"][:2000] for line in _corpus][:8]
TEXTS += ["", " a  b\n\nc", "<eos> then <bos>x<unk>", "Ünïcödé — “quotes”, emoji 😀\tand a tab"]


def _megatron_args(tokenizer_dir) -> SimpleNamespace:
    from megatron.training.arguments import parse_args

    argv, sys.argv = sys.argv, ["zaya", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                str(tokenizer_dir)]
    try:
        args = parse_args()
    finally:
        sys.argv = argv
    args.rank, args.pad_vocab_size = 0, False
    return args


def test_the_embedded_tokenizer_reads_as_transformers_and_megatron_read_it():
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from transformers import AutoTokenizer

    ours, theirs = TokenizerJson(EMBEDDED_DIR), AutoTokenizer.from_pretrained(str(EMBEDDED_DIR))
    for special in (True, False):
        assert ours(TEXTS, add_special_tokens=special) == {"input_ids": theirs(TEXTS, add_special_tokens=special)
                                                           ["input_ids"]}  # fmt: skip
        assert all(ours(t, add_special_tokens=special)["input_ids"] == theirs(t, add_special_tokens=special)
                   ["input_ids"] for t in TEXTS)  # fmt: skip
    assert (len(ours), ours.eos_token_id) == (len(theirs), theirs.eos_token_id) == (4096, 1)

    args = _megatron_args(EMBEDDED_DIR)
    megatron = build_tokenizer(args)
    assert ours.vocab == megatron.vocab and ours.inv_vocab == megatron.inv_vocab
    assert [(t.vocab_size, t.eod, t.eos, t.bos, t.pad) for t in (ours, megatron)] == [(4096, 1, 1, 2, 0)] * 2
    assert [ours.tokenize(t) for t in TEXTS] == [megatron.tokenize(t) for t in TEXTS]
    assert [ours.detokenize(ours.tokenize(t)) for t in TEXTS] == [megatron.detokenize(megatron.tokenize(t))
                                                                 for t in TEXTS]  # fmt: skip
    assert tokenizer_identity(ours, args) == tokenizer_identity(megatron, args)  # checkpoints of either resume


@pytest.mark.parametrize("change", [{"tokenizer_class": "LlamaTokenizerFast"}, {"chat_template": "{{ messages }}"},
                                    {"add_bos_token": True}], ids=["another-class", "chat-template", "adds-bos"])
def test_a_tokenizer_with_python_side_logic_goes_through_transformers(tmp_path, change):
    shutil.copytree(EMBEDDED_DIR, tmp_path / "tok", ignore=shutil.ignore_patterns("*.gz", "*.md"))
    config = tmp_path / "tok" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **change}))
    assert TokenizerJson.serves(EMBEDDED_DIR) and not TokenizerJson.serves(tmp_path / "tok")
    assert not isinstance(load_tokenizer(str(tmp_path / "tok")), TokenizerJson)
    assert isinstance(load_tokenizer(str(EMBEDDED_DIR)), TokenizerJson)


BUILD_IN_A_FRESH_PROCESS = """
import json, sys
from megatron_zaya.patches import apply_patches
apply_patches(sys.argv[1])
from megatron.training import global_vars
from megatron.training.arguments import parse_args
sys.argv = ["zaya", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", sys.argv[2]]
args = parse_args()
args.rank = 0
tokenizer = global_vars._build_tokenizer(args)
print(json.dumps([type(tokenizer).__name__, args.padded_vocab_size, "transformers" in sys.modules]))
"""


@pytest.mark.parametrize("patches", ["startup.tokenizer_json", "none"])
def test_megatron_builds_it_without_importing_transformers(patches):
    run = subprocess.run([sys.executable, "-c", BUILD_IN_A_FRESH_PROCESS, patches, str(EMBEDDED_DIR)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    name, padded, imported = json.loads(run.stdout.strip().splitlines()[-1])
    assert padded == 4096  # Megatron's padding (to a multiple of 128) either way
    assert (name, imported) == (("TokenizerJson", False) if patches != "none" else ("DefaultTokenizerText", True))
