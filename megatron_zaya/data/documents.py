"""Find input files and read documents out of them, for `zaya-preprocess`.

Formats, by file name (each optionally gzipped, `.gz`):
  *.txt    one document per block of lines separated by blank lines, or per line with split_lines
  *.jsonl  one JSON object per line, the document in one of its keys (json_key)
Every problem raises InputError with a one-line message that names the problem and the fix.
"""

import glob
import gzip
import json
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

from ..errors import InputError

FORMATS = (".txt", ".jsonl")


def input_format(path: Path) -> str:
    """'.txt' or '.jsonl', from the file name with any trailing '.gz' removed."""
    name = path.name.removesuffix(".gz")
    for suffix in FORMATS:
        if name.endswith(suffix):
            return suffix
    raise InputError(
        f"{path}: unknown input format; name text files *.txt and JSON-lines files *.jsonl (optionally .gz)"
    )


def expand_inputs(patterns: list[str]) -> list[Path]:
    """Expand globs and check that every file exists, is readable and has a known format."""
    paths = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise InputError(f"{pattern}: no file matches this pattern; check the path")
        paths.extend(Path(m) for m in matches)
    for path in paths:
        if not path.exists():
            raise InputError(f"{path}: no such file; check the path")
        if path.is_dir():
            raise InputError(f"{path} is a directory; pass its files, e.g. '{path}/*.jsonl'")
        if not os.access(path, os.R_OK):
            raise InputError(f"{path}: not readable; fix its permissions")
        input_format(path)
    return paths


def read_documents(path: Path, json_key: str = "text", split_lines: bool = False) -> Iterator[str]:
    """Yield the non-empty documents of one file, in file order."""
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as lines:
            if input_format(path) == ".jsonl":
                yield from _jsonl_documents(lines, path, json_key)
            elif split_lines:
                yield from (line.rstrip("\n") for line in lines if line.strip())
            else:
                yield from _paragraph_blocks(lines)
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not valid UTF-8 ({e.reason}); convert it to UTF-8") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise InputError(f"{path}: broken gzip file ({e}); re-create it or pass it uncompressed") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror}); check the file") from None


def _paragraph_blocks(lines: Iterator[str]) -> Iterator[str]:
    """Blocks of consecutive non-blank lines, joined with '\\n' (whitespace-only lines count as blank)."""
    block = []
    for line in lines:
        if line.strip():
            block.append(line.rstrip("\n"))
        elif block:
            yield "\n".join(block)
            block = []
    if block:
        yield "\n".join(block)


def _jsonl_documents(lines: Iterator[str], path: Path, json_key: str) -> Iterator[str]:
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: invalid JSON ({e.msg} at column {e.colno}); fix or remove that line") from None
        if not isinstance(record, dict) or json_key not in record:
            keys = ", ".join(record) if isinstance(record, dict) else f"a JSON {type(record).__name__}, not an object"
            raise InputError(f"{where}: no key '{json_key}' (found: {keys}); pass the right --json-key")
        text = record[json_key]
        if not isinstance(text, str):
            kind = type(text).__name__
            raise InputError(f"{where}: '{json_key}' holds a {kind}, not a string; pass the right --json-key")
        if text.strip():
            yield text

