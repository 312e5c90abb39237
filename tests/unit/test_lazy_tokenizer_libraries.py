"""Megatron's tokenizer libraries imported one at a time (the ``startup.lazy_tokenizer_libraries`` patch): the
``NullTokenizer`` of ``--mock-data`` comes out as Megatron builds it unpatched, without importing transformers, and
the classes the patch serves are those the package's own ``__init__`` exports."""

from __future__ import annotations

import json
import subprocess
import sys

from megatron_zaya.patches.startup import TOKENIZER_LIBRARY_CLASSES

BUILD_IN_A_FRESH_PROCESS = """
import json, sys
from types import SimpleNamespace
from megatron_zaya.patches import apply_patches
apply_patches(sys.argv[1])
from megatron.training import global_vars
from megatron.training.arguments import parse_args
from megatron_zaya.checkpoint.fits import tokenizer_identity
sys.argv = ["zaya", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255"]
args = parse_args()
args.rank = 0
tokenizer = global_vars._build_tokenizer(args)
built = [type(tokenizer).__name__, args.padded_vocab_size, tokenizer.vocab_size, tokenizer.eod,
         tokenizer.tokenize("3 1 4"), dict(tokenizer.unique_identifiers), tokenizer_identity(tokenizer, args)]
transformers = "transformers" in sys.modules
import megatron.core.tokenizers.text.libraries as libraries
exported = {name: getattr(libraries, name).__module__.rsplit(".", 1)[1] for name in dir(libraries)
            if name[0].isupper()}
print(json.dumps([built, transformers, exported]))
"""


def _build(patches: str):
    run = subprocess.run([sys.executable, "-c", BUILD_IN_A_FRESH_PROCESS, patches], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_mock_data_tokenizer_is_megatrons_without_transformers():
    patched, patched_imports, _ = _build("startup.lazy_tokenizer_libraries")
    unpatched, unpatched_imports, exported = _build("none")
    assert patched == unpatched
    assert patched[:5] == ["DefaultTokenizerText", 256, 255, 254, [3, 1, 4]]
    assert (patched_imports, unpatched_imports) == (False, True)
    assert exported == TOKENIZER_LIBRARY_CLASSES
