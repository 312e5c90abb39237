"""Patch group ``startup``: start-up bugs of the megatron-core wheel that hit every platform."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

from .registry import register, replace_attr

HELPERS_MODULE = "megatron.core.datasets.helpers_cpp"


def _datasets_dir() -> Path:
    spec = importlib.util.find_spec("megatron.core.datasets")
    return Path(spec.origin).parent


def _makefile_present() -> str | None:
    if (_datasets_dir() / "Makefile").exists():
        return "megatron/core/datasets has a Makefile (source install), so compile_helpers can build"
    return None


def check_prebuilt_helpers() -> None:
    """Stand-in for ``compile_helpers``: import the wheel's prebuilt dataset helpers, or fail saying why."""
    try:
        importlib.import_module(HELPERS_MODULE)
    except ImportError as error:
        raise RuntimeError(
            f"megatron-core's prebuilt dataset helpers ({_datasets_dir()}/helpers_cpp*.so) do not import: {error}. "
            "Fix: reinstall the wheel (pip install --force-reinstall megatron-core==0.19.2)"
        ) from error


@register(
    "startup.compile_helpers",
    target="megatron.core.datasets.utils.compile_helpers",
    requires=_makefile_present,
)
def patch_compile_helpers() -> None:
    """Replace ``compile_helpers`` (run ``make`` in the package) by an import check of the prebuilt helpers.

    ``megatron.training.initialize._compile_dependencies`` calls ``compile_helpers()`` on rank 0 at
    start-up. It runs ``make -C megatron/core/datasets``, but the megatron-core 0.19.2 wheel ships the
    prebuilt ``helpers_cpp*.so`` and no Makefile, so ``make`` fails and start-up ``sys.exit(1)``s on
    every platform. The replacement imports ``megatron.core.datasets.helpers_cpp`` and raises a clear
    error if that fails. It is patched on ``megatron.core.datasets.utils``, the module that
    ``_compile_dependencies`` imports the name from at call time. Skipped on a source install that has
    the Makefile. Off: leave ``startup.compile_helpers`` out of ``--zaya-patches`` / ``ZAYA_PATCHES``.
    """
    from megatron.core.datasets import utils

    replace_attr(utils, "compile_helpers", check_prebuilt_helpers)


@register("startup.arguments_to_file", target="megatron.training.arguments._print_args")
def arguments_to_file() -> None:
    """Keep Megatron's argument dump off the console, for the run directory's ``zaya-start.log``.

    ``validate_args`` prints every argument on rank 0 (``_print_args``, arguments.py:1909), some 840 lines
    before the first iteration. For zaya-pretrain runs (arguments with the ``--zaya-*`` flags) the
    replacement appends the same lines to ``megatron_zaya.runtime.START_LOG``; zaya-pretrain writes them,
    with the patch lines, into ``<--save>/zaya-start.log`` once its checks passed, and prints one line
    naming the file. Other callers keep the original.
    Off: leave ``startup.arguments_to_file`` out of ``--zaya-patches`` / ``ZAYA_PATCHES``.
    """
    from megatron.training import arguments

    from megatron_zaya.runtime import START_LOG

    original = arguments._print_args

    def _print_args(title, args):
        if not hasattr(args, "zaya_preset"):
            return original(title, args)
        START_LOG.append(f"------------------------ {title} ------------------------")
        START_LOG.extend(sorted((f"  {name} {'.' * (48 - len(name))} {value}" for name, value in vars(args).items()),
                                key=str.lower))
        return None

    replace_attr(arguments, "_print_args", _print_args)


COMPILE_DISABLED = "startup.compile_disabled"


def _compile_enabled() -> str | None:
    if os.environ.get("TORCH_COMPILE_DISABLE") != "1":
        return "TORCH_COMPILE_DISABLE is not 1: torch.compile compiles"
    return None


def _uncompiled(model=None, **options):
    """``torch.compile`` disabled: the model itself (as a decorator, a function that returns it)."""
    return (lambda function: function) if model is None else model


@register(COMPILE_DISABLED, target="torch.compile", requires=_compile_enabled)
def compile_disabled() -> None:
    """With ``TORCH_COMPILE_DISABLE=1``, ``torch.compile`` returns what it is given without importing dynamo.

    Disabled, ``torch.compile`` compiles nothing (dynamo's disabled ``optimize`` hands the function back), but it
    imports ``torch._dynamo`` and inductor first, and Megatron applies it at import to its fusion functions
    (``megatron.core.jit.jit_fuser``): 1.5 s of CPU per process with torch 2.14, for nothing. The replacement
    returns the model, as the disabled ``torch.compile`` does. zaya-pretrain applies it first, before it imports
    Megatron (``pretrain.main``), so it is selected by ``ZAYA_PATCHES`` or a ``--zaya-patches`` value as given,
    before Megatron's parser exists. Off: leave ``startup.compile_disabled`` out of them, or unset
    ``TORCH_COMPILE_DISABLE``.
    """
    import torch

    replace_attr(torch, "compile", _uncompiled)


def _serves_without_transformers(args) -> bool:
    """Whether ``args`` ask Megatron for a Hugging Face tokenizer that :class:`TokenizerJson` reads the same."""
    from megatron_zaya.data.tokenizer_json import TokenizerJson

    plain = not any(getattr(args, flag, None) for flag in ("special_tokens", "vocab_file", "merge_file",
                                                           "chat_template", "metadata_path"))
    model = args.tokenizer_model
    return (args.tokenizer_type == "HuggingFaceTokenizer" and plain and model is not None
            and TokenizerJson.serves(model))


@register("startup.tokenizer_json", target="megatron.training.global_vars.build_tokenizer")
def tokenizer_json() -> None:
    """Build a Hugging Face tokenizer of the generic fast class with the ``tokenizers`` library, not transformers.

    Megatron's ``HuggingFaceTokenizer`` loads every tokenizer through transformers' ``AutoTokenizer``: importing
    transformers takes 5-7 s of CPU per process (it indexes its 1,100 model files), in every launch that trains
    on the embedded corpus. A directory whose ``tokenizer_config.json`` names ``PreTrainedTokenizerFast`` (no
    Python-side logic: transformers runs the same Rust tokenizer) with no chat template or added tokens, given
    without Megatron's tokenizer options (special tokens, vocabulary and merge files, metadata), is read by
    :class:`megatron_zaya.data.tokenizer_json.TokenizerJson`: the same ids, vocabulary and special tokens (and so
    the same tokenizer identity in checkpoints), with the properties Megatron's GPT datasets use; the padded
    vocabulary is set as Megatron sets it. Any other tokenizer goes through Megatron's. The replacement is
    patched on ``megatron.training.global_vars``, whose ``_build_tokenizer`` calls it.
    Off: leave ``startup.tokenizer_json`` out of ``--zaya-patches`` / ``ZAYA_PATCHES``.
    """
    from megatron.core.tokenizers.utils.build_tokenizer import _set_padded_vocab_size
    from megatron.training import global_vars

    from megatron_zaya.data.tokenizer_json import TokenizerJson

    original = global_vars.build_tokenizer

    def build_tokenizer(args, **kwargs):
        if not _serves_without_transformers(args):
            return original(args, **kwargs)
        tokenizer = TokenizerJson(args.tokenizer_model)
        if args.pad_vocab_size:
            _set_padded_vocab_size(args, tokenizer)
        return tokenizer

    replace_attr(global_vars, "build_tokenizer", build_tokenizer)


TOKENIZER_LIBRARIES = "megatron.core.tokenizers.text.libraries"
#: What the package's ``__init__`` imports: each class and its submodule.
TOKENIZER_LIBRARY_CLASSES = {
    "ByteLevelTokenizer": "bytelevel_tokenizer", "HuggingFaceTokenizer": "huggingface_tokenizer",
    "MegatronHFTokenizer": "megatron_hf_tokenizer", "NullTokenizer": "null_tokenizer",
    "SentencePieceTokenizer": "sentencepiece_tokenizer", "SFTTokenizer": "sft_tokenizer",
    "TikTokenTokenizer": "tiktoken_tokenizer",
}


def _libraries_not_imported() -> str | None:
    if TOKENIZER_LIBRARIES in sys.modules:
        return f"{TOKENIZER_LIBRARIES} is already imported"
    return None


@register("startup.lazy_tokenizer_libraries", target=TOKENIZER_LIBRARIES, requires=_libraries_not_imported)
def lazy_tokenizer_libraries() -> None:
    """Megatron's tokenizer libraries imported one at a time, when a tokenizer of that library is built.

    The package's ``__init__`` imports all seven libraries, Hugging Face's among them, and so transformers: 1.1 s
    of CPU in every launch, where ``--mock-data`` builds a ``NullTokenizer`` and a SentencePiece or tiktoken
    tokenizer needs nothing of transformers. The replacement is the same package with its ``__init__`` left
    unrun: its submodules import as before, and each class it exported is imported from its own module when
    first read (a module ``__getattr__``), as ``MegatronTokenizerText._restore_model`` reads it. It must apply
    before anything imports the package, so it stands aside if something did. Off: leave
    ``startup.lazy_tokenizer_libraries`` out of ``--zaya-patches`` / ``ZAYA_PATCHES``.
    """
    # found from the grandparent: find_spec imports the parent package, whose __init__ imports this one
    grandparent, parent, _ = TOKENIZER_LIBRARIES.rsplit(".", 2)
    location = Path(importlib.util.find_spec(grandparent).submodule_search_locations[0]) / parent
    spec = importlib.machinery.PathFinder.find_spec(TOKENIZER_LIBRARIES, [str(location)])
    package = importlib.util.module_from_spec(spec)  # its __path__ and __spec__, its __init__ not run

    def __getattr__(name: str):
        if name not in TOKENIZER_LIBRARY_CLASSES:
            raise AttributeError(f"module {TOKENIZER_LIBRARIES!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{TOKENIZER_LIBRARIES}.{TOKENIZER_LIBRARY_CLASSES[name]}"), name)

    package.__getattr__ = __getattr__
    sys.modules[TOKENIZER_LIBRARIES] = package


@register("startup.argument_help_once",
          target="megatron.training.argument_utils.ArgumentGroupFactory._get_field_docstrings")
def argument_help_once() -> None:
    """Megatron's help texts of its config dataclasses' fields are read once per process, not at every parse.

    ``ArgumentGroupFactory`` reads them with ``inspect.getsource`` and ``ast.parse`` of each class and its bases
    whenever it adds a class's arguments to a parser, and a zaya-pretrain process builds Megatron's parser four
    times (its own flags, the command's parse, Megatron's, fault tolerance's): 0.2 s of CPU per process for the
    same texts. The replacement keeps each class's texts (a class's source does not change while it runs).
    Off: leave ``startup.argument_help_once`` out of ``--zaya-patches`` / ``ZAYA_PATCHES``.
    """
    from megatron.training.argument_utils import ArgumentGroupFactory

    original, texts = ArgumentGroupFactory._get_field_docstrings, {}

    def field_docstrings(self, src_cfg_class: type) -> dict[str, str]:
        if src_cfg_class not in texts:  # (the original recurses into the base classes through this method)
            texts[src_cfg_class] = original(self, src_cfg_class)
        return dict(texts[src_cfg_class])

    replace_attr(ArgumentGroupFactory, "_get_field_docstrings", field_docstrings)
