"""The installed `zaya-preprocess` console script, end to end in a subprocess."""

import json
import subprocess
import sys
from pathlib import Path

from megatron.core.datasets.indexed_dataset import IndexedDataset
from tokenizers import Tokenizer

from megatron_zaya.data import embedded_tokenizer_dir

SCRIPT = Path(sys.executable).parent / "zaya-preprocess"
REFERENCE = Tokenizer.from_file(str(Path(embedded_tokenizer_dir()) / "tokenizer.json"))


def run_cli(*args, cwd):
    assert SCRIPT.exists(), f"{SCRIPT} missing: install the package with `pip install -e .`"
    return subprocess.run([str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_jsonl_glob_with_workers_and_default_tokenizer(tmp_path):
    docs = [f"Document {i}: " + "It is a truth universally acknowledged. " * (i % 5 + 1) for i in range(300)]
    for part in range(2):
        lines = [json.dumps({"text": d}) for d in docs[part * 150 : (part + 1) * 150]]
        (tmp_path / f"part{part}.jsonl").write_text("\n".join(lines) + "\n")

    result = run_cli("part*.jsonl", "--output-prefix", "out", "--workers", "2", cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    assert f"wrote {len(docs)} documents" in result.stdout
    dataset = IndexedDataset(str(tmp_path / "out"))
    eos = REFERENCE.token_to_id("<eos>")
    assert [dataset[i].tolist() for i in range(len(dataset))] == [REFERENCE.encode(d).ids + [eos] for d in docs]


def test_bad_input_exits_2_and_writes_nothing(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "fine"}\n{"text": broken}\n')

    result = run_cli("in.jsonl", "--output-prefix", "out", cwd=tmp_path)

    assert result.returncode == 2
    # Library import warnings may precede it; the error itself is the last line, alone.
    assert result.stderr.strip().splitlines()[-1].startswith("zaya-preprocess: error: in.jsonl:2: invalid JSON")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
