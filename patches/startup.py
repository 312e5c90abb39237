"""Patch group ``startup``: start-up bugs of the megatron-core wheel that hit every platform."""

from __future__ import annotations

import importlib
import importlib.util
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
