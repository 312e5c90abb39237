"""A tokenizer directory of the generic fast class (``tokenizer.json`` with a ``tokenizer_config.json`` naming
``PreTrainedTokenizerFast``) read with the ``tokenizers`` library alone.

Such a tokenizer has no Python-side logic: transformers' ``PreTrainedTokenizerFast`` runs the same Rust tokenizer,
so the ids, the vocabulary and the special tokens are the same. Loading it this way skips importing transformers,
seconds of every launch that trains on the embedded corpus (or any such tokenizer) and of each tokenisation. It
serves Megatron as its ``HuggingFaceTokenizer`` does (the ``startup.tokenizer_json`` patch) and
``zaya-preprocess`` as transformers' tokenizer does (``__call__``); any other tokenizer goes through transformers.
"""

from __future__ import annotations

import json
import operator
from collections import OrderedDict
from pathlib import Path

GENERIC_CLASS = "PreTrainedTokenizerFast"
SPECIAL = ("bos", "eos", "pad", "unk", "sep", "cls", "mask")


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class TokenizerJson:
    """``tokenizers.Tokenizer`` of ``directory``, with Megatron's ``HuggingFaceTokenizer`` properties."""

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer

        self.path = str(directory)
        self.config = json.loads((Path(directory) / "tokenizer_config.json").read_text())
        self._tokenizer = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
        self._vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        for name in SPECIAL:  # bos_token, bos_id, ...: the token's text and its id, or None
            text = _token_text(self.config.get(f"{name}_token"))
            setattr(self, f"{name}_token", text)
            setattr(self, f"{name}_id", None if text is None else self._tokenizer.token_to_id(text))

    @staticmethod
    def serves(directory: str | Path) -> bool:
        """Whether ``directory`` holds a tokenizer of the generic fast class, with nothing transformers adds."""
        config = Path(directory) / "tokenizer_config.json"
        if not (Path(directory) / "tokenizer.json").is_file() or not config.is_file():
            return False
        settings = json.loads(config.read_text())
        return settings.get("tokenizer_class") == GENERIC_CLASS and not settings.get("chat_template") and not any(
            settings.get(key) for key in ("add_bos_token", "add_eos_token", "additional_special_tokens"))

    # Megatron's tokenizer interface (megatron.core.tokenizers' TextTokenizer over its HuggingFaceTokenizer)
    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab(self) -> list[str]:
        """Each id's token, in id order (Megatron's ``HuggingFaceTokenizer.vocab``)."""
        by_id = self.inv_vocab
        return [by_id[i] for i in range(len(by_id))]

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: token for token, i in self._vocab.items()}

    # the special tokens' ids under Megatron's names (and transformers' eos_token_id, below)
    eod = eos = property(operator.attrgetter("eos_id"))
    bos = property(operator.attrgetter("bos_id"))
    pad = property(operator.attrgetter("pad_id"))
    unk = property(operator.attrgetter("unk_id"))

    @property
    def unique_identifiers(self) -> OrderedDict:
        name = f"{type(self).__module__}.{type(self).__qualname__}"
        return OrderedDict([("class", name), ("tokenizer_path", self.path)])

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def detokenize(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    # transformers' interface, as zaya-preprocess uses it
    eos_token_id = eod

    def __len__(self) -> int:
        return self.vocab_size

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, verbose: bool = True) -> dict:
        """``{"input_ids": ...}``: the ids of ``text``, or of each of its texts."""
        if isinstance(text, str):
            return {"input_ids": self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids}
        encoded = self._tokenizer.encode_batch(text, add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encoded]}
