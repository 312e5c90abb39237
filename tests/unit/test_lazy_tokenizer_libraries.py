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
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.training.arguments import parse_args
from megatron_zaya.checkpoint.fits import tokenizer_identity
from megatron_zaya.patches import apply_patches
from megatron_zaya.patches.startup import TOKENIZER_LIBRARIES

sys.argv = ["zaya", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255"]
args = parse_args()
args.rank = 0

def built():
    tokenizer = build_tokenizer(args)
    return [type(tokenizer).__name__, args.padded_vocab_size, tokenizer.vocab_size, tokenizer.eod,
            tokenizer.tokenize("3 1 4"), dict(tokenizer.unique_identifiers), tokenizer_identity(tokenizer, args),
            "transformers" in sys.modules]

apply_patches("startup.lazy_tokenizer_libraries")
patched = built()
del sys.modules[TOKENIZER_LIBRARIES]  # the package as Megatron ships it: its __init__ runs at the next import
megatron = built()
import megatron.core.tokenizers.text.libraries as libraries
exported = {name: getattr(libraries, name).__module__.rsplit(".", 1)[1] for name in dir(libraries)
            if name[0].isupper()}
print(json.dumps([patched, megatron, exported]))
"""


def test_the_mock_data_tokenizer_is_megatrons_without_transformers():
    run = subprocess.run([sys.executable, "-c", BUILD_IN_A_FRESH_PROCESS], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    patched, megatron, exported = json.loads(run.stdout.strip().splitlines()[-1])
    assert patched[:-1] == megatron[:-1]
    assert patched[:5] == ["DefaultTokenizerText", 256, 255, 254, [3, 1, 4]]
    assert (patched[-1], megatron[-1]) == (False, True)  # transformers imported by Megatron's package alone
    assert exported == TOKENIZER_LIBRARY_CLASSES
