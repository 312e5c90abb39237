"""zaya-preprocess: documents in -> Megatron .bin/.idx out, checked by reading back with Megatron's
IndexedDataset against the raw `tokenizers` library encoding each document on its own."""

import ctypes
import gzip
import json
import multiprocessing
import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tokenizers import Tokenizer

from megatron_zaya.data import embedded_tokenizer_dir
from megatron_zaya.data.embedded import EMBEDDED_CORPUS
from megatron_zaya.data.preprocess import load_tokenizer, main, write_indexed_dataset

REFERENCE = Tokenizer.from_file(str(Path(embedded_tokenizer_dir()) / "tokenizer.json"))
EOS = REFERENCE.token_to_id("<eos>")

DOCUMENTS = [
    "It is a truth universally acknowledged.",
    "Two lines\nin one document, with  double spaces.",
    "Ünïcödé — “quotes”, emoji 😀 and a tab\there.",
    "x",
]


def expected_tokens(doc: str, eod: bool = True) -> list[int]:
    return REFERENCE.encode(doc).ids + ([EOS] if eod else [])


def read_back(prefix) -> list[list[int]]:
    dataset = IndexedDataset(str(prefix))
    assert dataset.index.dtype == np.uint16  # 4096 entries fit in 16 bits
    np.testing.assert_array_equal(dataset.document_indices, np.arange(len(dataset) + 1))  # one sequence per doc
    return [dataset[i].tolist() for i in range(len(dataset))]


def write_jsonl(path, docs, key="text"):
    path.write_text("".join(json.dumps({"id": i, key: d}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")


def test_jsonl_round_trip(tmp_path):
    write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS, key="body")
    summary = write_indexed_dataset([str(tmp_path / "docs.jsonl")], str(tmp_path / "out"), embedded_tokenizer_dir(),
                                    json_key="body", progress=False)
    expected = [expected_tokens(d) for d in DOCUMENTS]
    assert read_back(tmp_path / "out") == expected
    assert (summary.documents, summary.tokens) == (len(DOCUMENTS), sum(map(len, expected)))


def test_txt_paragraphs_lines_gzip_and_globs(tmp_path):
    # Blank lines (also whitespace-only ones, and runs of them) separate documents.
    (tmp_path / "a.txt").write_text("\n\n".join(DOCUMENTS[:2]) + "\n \t\n\n" + DOCUMENTS[2] + "\n", encoding="utf-8")
    with gzip.open(tmp_path / "b.txt.gz", "wt", encoding="utf-8") as f:
        f.write(DOCUMENTS[3])
    write_indexed_dataset([str(tmp_path / "*.txt*")], str(tmp_path / "paragraphs"), embedded_tokenizer_dir(),
                          progress=False)
    assert read_back(tmp_path / "paragraphs") == [expected_tokens(d) for d in DOCUMENTS]

    write_indexed_dataset([str(tmp_path / "a.txt")], str(tmp_path / "lines"), embedded_tokenizer_dir(),
                          split_lines=True, append_eod=False, progress=False)
    lines = [line for d in DOCUMENTS[:3] for line in d.split("\n")]
    assert read_back(tmp_path / "lines") == [expected_tokens(line, eod=False) for line in lines]


def test_workers_write_the_same_bytes_as_one_process(tmp_path):
    # Enough documents for many batches in flight, of uneven lengths.
    docs = [" ".join(DOCUMENTS[i % 4] for _ in range(1 + i % 7)).replace("\n", " ") for i in range(700)]
    (tmp_path / "many.txt").write_text("\n".join(docs) + "\n", encoding="utf-8")
    for workers in (1, 2):
        write_indexed_dataset([str(tmp_path / "many.txt")], str(tmp_path / f"w{workers}"), embedded_tokenizer_dir(),
                              split_lines=True, workers=workers, progress=False)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"w1{suffix}").read_bytes() == (tmp_path / f"w2{suffix}").read_bytes()
    assert read_back(tmp_path / "w2") == [expected_tokens(d) for d in docs]


def _grow(result, source: str, prefix: str) -> None:
    """In a fresh process: the tokenizer loaded (what every run holds), the heap trimmed and the kernel's
    high-water mark reset, then by how much preprocessing ``source`` raised that mark."""
    load_tokenizer(embedded_tokenizer_dir())
    ctypes.CDLL(None).malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # 5: reset the high-water mark (VmHWM)
    before = _high_water_mark()
    write_indexed_dataset([source], prefix, embedded_tokenizer_dir(), progress=False)
    result.put(_high_water_mark() - before)


def peak_memory_growth(source: Path, prefix: Path) -> int:
    """Bytes by which preprocessing ``source`` raises a process's peak resident memory: measured in a spawned
    child (a fork of this multi-threaded test process could deadlock)."""
    context = multiprocessing.get_context("spawn")
    result = context.Queue()
    child = context.Process(target=_grow, args=(result, str(source), str(prefix)))
    child.start()
    child.join(timeout=300)
    assert child.exitcode == 0, f"the measured child failed (exit code {child.exitcode})"
    return result.get(timeout=10)


def _high_water_mark() -> int:
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024


def test_a_long_line_is_tokenised_as_a_whole_in_memory_bounded_by_its_size(tmp_path):
    # 2 MiB of prose in one JSON line, between two short documents of the same batch: the tokenizer takes
    # about 170 bytes per character of text it is given at once.
    with gzip.open(EMBEDDED_CORPUS, "rt", encoding="utf-8") as corpus:
        prose = "\n\n".join(json.loads(line)["text"] for line in corpus) + "  \t \n"
    long_text = (prose * 2)[: 2 << 20]
    documents = [DOCUMENTS[0], long_text, DOCUMENTS[2]]
    write_jsonl(tmp_path / "long.jsonl", documents)
    write_jsonl(tmp_path / "short.jsonl", DOCUMENTS)
    growth = (peak_memory_growth(tmp_path / "long.jsonl", tmp_path / "long")
              - peak_memory_growth(tmp_path / "short.jsonl", tmp_path / "short"))

    line_bytes = len(json.dumps({"id": 1, "text": long_text}))
    tokenizer_state = 16 << 20  # what the tokenizer holds whatever the length: its cache of words, one piece
    assert growth < 8 * line_bytes + tokenizer_state, f"grew {growth / 2**20:.1f} MiB for a {line_bytes} byte line"
    reference = IndexedDatasetBuilder(str(tmp_path / "reference.bin"), dtype=np.uint16)
    for document in documents:
        ids = np.array(expected_tokens(document))
        reference.add_document(ids, [ids.size])
    reference.finalize(str(tmp_path / "reference.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"long{suffix}").read_bytes() == (tmp_path / f"reference{suffix}").read_bytes()


def test_overwrite_replaces_existing_output(tmp_path):
    write_jsonl(tmp_path / "one.jsonl", DOCUMENTS[:1])
    write_jsonl(tmp_path / "two.jsonl", DOCUMENTS[1:3])
    main([str(tmp_path / "one.jsonl"), "--output-prefix", str(tmp_path / "out")])
    main([str(tmp_path / "two.jsonl"), "--output-prefix", str(tmp_path / "out"), "--overwrite"])
    assert read_back(tmp_path / "out") == [expected_tokens(d) for d in DOCUMENTS[1:3]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.jsonl", "out.bin", "out.idx", "two.jsonl"]


def _good_then_bad_jsonl(tmp_path):
    # The bad line comes after several batches were tokenised and written to the temporary file.
    write_jsonl(tmp_path / "in.jsonl", DOCUMENTS * 100)
    with open(tmp_path / "in.jsonl", "a") as f:
        f.write('{"text": "unterminated}\n')
    return ["in.jsonl", "--workers", "2"], "in.jsonl:401: invalid JSON"


def _missing_key(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", DOCUMENTS[:2])
    with open(tmp_path / "in.jsonl", "a") as f:
        f.write('{"content": "x"}\n')
    return ["in.jsonl"], "in.jsonl:3: no key 'text' (found: content); pass the right --json-key"


def _not_a_string(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": ["a", "b"]}\n')
    return ["in.jsonl"], "in.jsonl:1: 'text' holds a list, not a string"


def _missing_file(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", DOCUMENTS)
    return ["in.jsonl", "nope.txt"], "nope.txt: no such file; check the path"


def _glob_matches_nothing(tmp_path):
    return ["*.jsonl"], "*.jsonl: no file matches this pattern"


def _directory(tmp_path):
    (tmp_path / "sub").mkdir()
    return ["sub"], "sub is a directory; pass its files"


def _unknown_format(tmp_path):
    (tmp_path / "in.csv").write_text("a,b\n")
    return ["in.csv"], "in.csv: unknown input format; name text files *.txt and JSON-lines files *.jsonl"


def _not_utf8(tmp_path):
    (tmp_path / "in.txt").write_bytes(b"caf\xe9\n")
    return ["in.txt"], "in.txt: not valid UTF-8"


def _broken_gzip(tmp_path):
    (tmp_path / "in.txt.gz").write_bytes(b"not gzip")
    return ["in.txt.gz"], "in.txt.gz: broken gzip file"


def _empty_corpus(tmp_path):
    (tmp_path / "in.txt").write_text("\n  \n\n")
    write_jsonl(tmp_path / "in.jsonl", ["", "   "])
    return ["in.txt", "in.jsonl"], "no documents in"


def _existing_output(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", DOCUMENTS)
    (tmp_path / "out.idx").write_bytes(b"someone else's dataset")
    return ["in.jsonl"], "out.idx already exists; pass --overwrite"


def _missing_output_dir(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", DOCUMENTS)
    return ["in.jsonl", "--output-prefix", "no/such/dir/out"], "output directory"


def _missing_tokenizer_dir(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", DOCUMENTS)
    return ["in.jsonl", "--tokenizer", "./no-tokenizer"], "tokenizer directory ./no-tokenizer does not exist"


def _output_where_no_file_can_be_made(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", DOCUMENTS)  # /proc takes no new files, whatever os.access says for root
    return ["in.jsonl", "--output-prefix", "/proc/zaya-out"], "/proc"


@pytest.mark.parametrize("make_case", [
    _good_then_bad_jsonl, _missing_key, _not_a_string, _missing_file, _glob_matches_nothing, _directory,
    _unknown_format, _not_utf8, _broken_gzip, _empty_corpus, _existing_output, _missing_output_dir,
    _missing_tokenizer_dir, _output_where_no_file_can_be_made,
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(make_case, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv, expected_message = make_case(tmp_path)
    if "--output-prefix" not in argv:
        argv += ["--output-prefix", "out"]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

    with pytest.raises(SystemExit) as exit_info:
        main(argv)

    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("zaya-preprocess: error: ")
    assert expected_message in err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_a_disk_that_fills_while_writing_exits_2_with_one_line_and_leaves_nothing(tmp_path):
    """The .bin outgrows the file-size limit (RLIMIT_FSIZE, as a full disk fails a write): one line, exit 2, and
    neither the partial temporary file nor any output is left behind."""
    write_jsonl(tmp_path / "in.jsonl", [DOCUMENTS[0] * 20] * 400)  # ~100 KiB of tokens

    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))

    run = subprocess.run([sys.executable, "-m", "megatron_zaya.data.preprocess", "in.jsonl", "--output-prefix", "out"],
                         cwd=tmp_path, preexec_fn=limited, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-1] == (
        "zaya-preprocess: error: writing out.bin/.idx failed (File too large); free space or change --output-prefix")
    assert "Traceback" not in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
