"""Check that this Python runs megatron-zaya on the megatron-core its setup.py pins, unshadowed.

Images such as AMD's rocm/primus carry Megatron-LM source checkouts, and clusters export
PYTHONPATHs into containers; either can put a second `megatron` package in front of the pinned
megatron-core wheel, and the training then runs on other code without saying so. This script finds
what `import megatron.core` / `import megatron.training` would load, the way `python -m` sees the
import path (working directory first, then PYTHONPATH, then site-packages), and compares it with the
files of the installed megatron-core distribution, whose version must satisfy megatron-zaya's pin.

    python3 examples/launch/check_install.py [--torch-backend rocm|cuda]

Run by Dockerfile.rocm at build time and by examples/slurm/node_launch.sh on every node. Prints one
"ok:" line and exits 0, or prints one "error:" line per problem and exits 1. Nothing is imported
beyond the `megatron` namespace itself (and torch with --torch-backend), so it takes milliseconds.
"""

import argparse
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

PACKAGE = "megatron-zaya"
MEGATRON_DIST = "megatron-core"
MEGATRON_MODULES = ("megatron.core", "megatron.training")
BACKEND_NAMES = {"rocm": "ROCm", "cuda": "CUDA"}


def _pinned_megatron() -> Requirement:
    for line in importlib.metadata.requires(PACKAGE) or []:
        requirement = Requirement(line)
        if requirement.name == MEGATRON_DIST:
            return requirement
    raise LookupError(f"{PACKAGE}'s requirements name no {MEGATRON_DIST}")


def _python_problems() -> list[str]:
    requires_python = importlib.metadata.metadata(PACKAGE)["Requires-Python"]
    running = ".".join(map(str, sys.version_info[:3]))
    if requires_python and running not in SpecifierSet(requires_python):
        return [f"Python {running} does not satisfy {PACKAGE}'s Requires-Python {requires_python}"]
    return []


def _megatron_problems(pin: Requirement) -> list[str]:
    dist = importlib.metadata.distribution(MEGATRON_DIST)
    if dist.version not in pin.specifier:
        return [
            f"{MEGATRON_DIST} {dist.version} is installed (from {dist.locate_file('')}) but {PACKAGE} "
            f"needs {pin}; run: pip install '{pin}'"
        ]
    problems = []
    wheel_megatron = Path(dist.locate_file("megatron")).resolve()
    for module in MEGATRON_MODULES:
        expected = wheel_megatron / module.split(".")[1] / "__init__.py"
        try:
            spec = importlib.util.find_spec(module)
        except Exception as exc:  # a shadowing `megatron/__init__.py` may fail on import
            problems.append(f"finding {module} failed: {exc!r}")
            continue
        found = Path(spec.origin).resolve() if spec and spec.origin else None
        if found != expected:
            root = found.parents[2] if found else "?"
            problems.append(
                f"{module} would be imported from {found}, not from the {MEGATRON_DIST} {dist.version} "
                f"wheel ({expected}); remove {root} from PYTHONPATH or leave that working directory"
            )
    import megatron  # the namespace package; safe once find_spec has run

    for portion in {Path(p).resolve() for p in megatron.__path__} - {wheel_megatron}:
        problems.append(
            f"another 'megatron' directory is on the import path: {portion}; remove "
            f"{portion.parent} from PYTHONPATH or leave that working directory"
        )
    return problems


def _torch_problems(backend: str) -> list[str]:
    import torch

    version = torch.version.hip if backend == "rocm" else torch.version.cuda
    if version is None:
        return [
            f"torch {torch.__version__} is not a {BACKEND_NAMES[backend]} build; something replaced "
            f"the image's torch: reinstall its {BACKEND_NAMES[backend]} wheel"
        ]
    return []


def find_problems(torch_backend: str | None) -> tuple[str, list[str]]:
    """Returns (summary of what was found, one message per problem)."""
    try:
        pin = _pinned_megatron()
    except importlib.metadata.PackageNotFoundError:
        return "", [f"{PACKAGE} is not installed in {sys.executable}; pip install it first"]
    except LookupError as exc:
        return "", [str(exc)]
    try:
        problems = _python_problems() + _megatron_problems(pin)
    except importlib.metadata.PackageNotFoundError:
        return "", [f"{MEGATRON_DIST} is not installed in {sys.executable}; run: pip install '{pin}'"]
    if torch_backend:
        problems += _torch_problems(torch_backend)
    return f"{PACKAGE} on {pin} (unshadowed), Python {sys.version.split()[0]}", problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch-backend", choices=("rocm", "cuda"), help="also require this torch build")
    args = parser.parse_args()
    # `python -m` (so `zaya-torchrun -m`) puts the working directory first; a console script does not,
    # so checking it is stricter than a console script needs, never looser.
    sys.path.insert(0, os.getcwd())
    summary, problems = find_problems(args.torch_backend)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if not problems:
        print(f"ok: {summary}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
