"""Every test that README.md and docs/ name as evidence exists, under that file and function name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
TEST_FILES = {path.name: path for path in (REPO / "tests").rglob("test_*.py")}
NAMED = re.compile(r"`((?:tests/[\w/]+/)?(test_\w+\.py))(?:::(\w+))?")


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_the_tests_a_doc_names_exist(doc):
    missing = []
    for match in NAMED.finditer(doc.read_text()):
        path, name, function = match.groups()
        test_file = REPO / path if path.startswith("tests/") else TEST_FILES.get(name)
        if test_file is None or not test_file.is_file():
            missing.append(path)
        elif function and not re.search(rf"def {function}\b", test_file.read_text()):
            missing.append(f"{path}::{function}")
    assert not missing, missing
