"""The patch-hook registry (selection, idempotence, kernel-patch errors), the ``zaya-patches`` CLI and the
``startup.compile_helpers`` and ``startup.compile_disabled`` patches.

The registry tests use throwaway patches of a ``zztest`` group that count their calls; they are removed
from the registry afterwards.
"""

import importlib
import json
import os
import subprocess
import sys

import pytest

from megatron_zaya.errors import PatchError
from megatron_zaya.patches import registry
from megatron_zaya.patches.cli import main as zaya_patches
from megatron_zaya.patches.registry import apply_patches, register, resolve

CALLS: list[str] = []


@pytest.fixture
def throwaway_patches():
    """``zztest.counted`` (applies everywhere) and ``zztest.kernel`` (a kernel patch that never applies)."""
    registry._load_patch_modules()  # so the real patches are registered before ours, as in a run

    @register("zztest.counted", target="zztest.module.symbol")
    def counted():
        """Count one call (a test patch). Off: leave zztest out of the selection."""
        CALLS.append("zztest.counted")

    @register("zztest.kernel", target="zztest.module.kernel", kernel=True, requires=lambda: "no such kernel here")
    def kernel():
        """A kernel patch whose requirement never holds (a test patch)."""
        CALLS.append("zztest.kernel")

    CALLS.clear()
    yield
    for patch_id in ("zztest.counted", "zztest.kernel"):
        registry.REGISTRY.pop(patch_id, None)
        registry._APPLIED.discard(patch_id)


def ids(patches):
    return {patch.id for patch in patches}


def test_selection_by_id_group_all_and_none(throwaway_patches):
    assert ids(resolve("zztest.counted")[0]) == {"zztest.counted"}
    chosen, explicit = resolve("zztest")
    assert ids(chosen) == explicit == {"zztest.counted", "zztest.kernel"}
    assert ids(resolve("all")[0]) == set(registry.REGISTRY) and resolve("all")[1] == set()
    assert resolve("none") == ([], set())
    assert ids(resolve(" zztest.kernel , zztest.counted ")[0]) == {"zztest.counted", "zztest.kernel"}


def test_patches_of_one_target_nest_the_same_way_whatever_the_selection_order():
    """``reliability.step_guard`` must wrap what ``optim.zaya_muon`` installs, or the guard is skipped."""
    for selection in ("optim.zaya_muon,reliability.step_guard", "reliability.step_guard,optim.zaya_muon"):
        assert [p.id for p in resolve(selection)[0]] == ["optim.zaya_muon", "reliability.step_guard"], selection


def test_every_patch_applies_after_the_patches_it_wraps():
    """Each pair of patches of one target declares which wraps the other, and the order they apply keeps it."""
    registry.check_nesting()
    for selection in ("all", ",".join(reversed(list(registry.REGISTRY)))):
        position = {patch.id: i for i, patch in enumerate(resolve(selection)[0])}
        for patch in registry.REGISTRY.values():
            assert all(position[inner] < position[patch.id] for inner in patch.wraps), (selection, patch.id)
    nested = [p.id for p in resolve("all")[0] if p.target == "megatron.training.training.save_checkpoint"]
    assert nested == ["reliability.save_failure", "reliability.watchdog_saves", "checkpointing.one_write_in_flight",
                      "checkpointing.loss_curve_at_saves"]


def test_two_patches_of_one_target_without_a_declared_order_are_refused(throwaway_patches):
    @register("zztest.unordered", target="zztest.module.symbol")
    def unordered():
        """Wraps the same target as zztest.counted, declaring no order (a test patch)."""

    try:
        with pytest.raises(PatchError, match=r"zztest\.counted and zztest\.unordered both wrap zztest\.module\.symbol "
                                             r"without a declared order"):
            resolve("zztest")
        registry.REGISTRY.pop("zztest.unordered")

        @register("zztest.unordered", target="zztest.module.symbol", wraps=("zztest.counted",))
        def ordered():
            """Wraps zztest.counted (a test patch)."""

        assert [p.id for p in resolve("zztest.unordered,zztest.counted")[0]] == ["zztest.counted", "zztest.unordered"]

        @register("zztest.counted", target="zztest.module.symbol", wraps=("zztest.unordered",))
        def counted_outside():
            """Wraps zztest.unordered, which wraps it (a test patch)."""

        with pytest.raises(PatchError, match=r"zztest\.\w+ wraps itself"):
            resolve("zztest")
    finally:
        registry.REGISTRY.pop("zztest.unordered", None)


def test_environment_variable_selects_when_no_selection_is_given(throwaway_patches, monkeypatch):
    monkeypatch.setenv("ZAYA_PATCHES", "zztest.counted")
    assert ids(resolve(None)[0]) == {"zztest.counted"}
    monkeypatch.delenv("ZAYA_PATCHES")
    assert ids(resolve(None)[0]) == set(registry.REGISTRY)  # default: all


def test_unknown_id_names_the_token_and_the_known_ones(throwaway_patches):
    with pytest.raises(PatchError, match=r"unknown patch or group 'zztest\.nope'.*known: all, none, .*zztest\.counted"):
        resolve("zztest.counted,zztest.nope")


def test_applying_twice_runs_the_patch_once(throwaway_patches):
    lines = []
    assert apply_patches("zztest.counted", log=lines.append) == {"zztest.counted": "applied"}
    assert apply_patches("zztest.counted", log=lines.append) == {"zztest.counted": "already applied"}
    assert CALLS == ["zztest.counted"]
    assert "zztest.counted" in registry.applied()
    assert lines == ["[zaya-patches] zztest.counted                   applied  (zztest.module.symbol)"]


def test_kernel_patch_asked_for_by_name_but_not_applicable_raises(throwaway_patches):
    with pytest.raises(PatchError, match="kernel patch zztest.kernel was asked for but cannot apply: no such kernel"):
        apply_patches("zztest.kernel", log=lambda line: None)
    with pytest.raises(PatchError, match="zztest.kernel"):
        apply_patches("zztest", log=lambda line: None)  # named through its group: explicit too
    assert "zztest.kernel" not in CALLS


def test_kernel_patch_reached_through_all_is_skipped_with_its_reason(throwaway_patches, monkeypatch):
    monkeypatch.setattr(registry, "REGISTRY", {k: v for k, v in registry.REGISTRY.items() if k.startswith("zztest")})
    report = apply_patches("all", log=lambda line: None)
    assert report == {"zztest.counted": "applied", "zztest.kernel": "skipped: no such kernel here"}


def test_a_patch_without_docstring_is_refused():
    with pytest.raises(PatchError, match="zztest.undocumented needs a docstring"):
        register("zztest.undocumented", target="x.y")(lambda: None)
    assert "zztest.undocumented" not in registry.REGISTRY


def test_replace_attr_fails_loudly_when_the_target_moved():
    class Owner:
        present = 1

    assert registry.replace_attr(Owner, "present", 2) == 1 and Owner.present == 2
    with pytest.raises(PatchError, match=r"\.gone no longer exists: megatron-core changed under this patch"):
        registry.replace_attr(Owner, "gone", 3)


def test_startup_and_cpu_patches_are_documented_and_scoped():
    registry._load_patch_modules()
    ours = [patch for patch in registry.REGISTRY.values() if patch.group in ("startup", "cpu")]
    assert {"startup.compile_helpers", "cpu.rng", "cpu.current_device", "cpu.initialize"} <= {p.id for p in ours}
    for patch in ours:
        assert len(patch.doc.splitlines()) >= 2 and patch.summary, patch.id
        assert patch.megatron == "==0.19.2", patch.id
        assert patch.platforms == (("cpu",) if patch.group == "cpu" else registry.PLATFORMS), patch.id


# --- zaya-patches CLI ----------------------------------------------------------------------------


def test_cli_list_prints_one_row_per_patch_with_whether_it_applies(throwaway_patches, capsys):
    zaya_patches(["list"])
    out = capsys.readouterr().out
    header, *rows = out.splitlines()[1:]
    assert header.split() == ["id", "group", "target", "platforms", "megatron", "kernel", "applies", "here", "summary"]
    assert len(rows) == len(registry.REGISTRY)
    kernel_row = next(row for row in rows if row.startswith("zztest.kernel "))
    assert "zztest.module.kernel" in kernel_row and "no: no such kernel here" in kernel_row
    assert "yes" in kernel_row.split("no:")[0]  # the kernel column
    counted_row = next(row for row in rows if row.startswith("zztest.counted "))
    assert counted_row.rstrip().endswith("Count one call (a test patch). Off: leave zztest out of the selection.")


def test_cli_show_prints_the_docstring(throwaway_patches, capsys):
    zaya_patches(["show", "zztest.kernel"])
    out = capsys.readouterr().out
    assert "replaces   zztest.module.kernel" in out and "skipped: no such kernel here" in out
    assert out.rstrip().endswith("A kernel patch whose requirement never holds (a test patch).")
    zaya_patches(["show", "reliability.step_guard"])
    assert "replaces   megatron.training.training.get_megatron_optimizer, around optim.zaya_muon" in (
        capsys.readouterr().out)


def test_cli_show_unknown_id_is_a_one_line_error():
    with pytest.raises(SystemExit, match=r"unknown patch id 'cpu\.nope'; run `zaya-patches list`"):
        zaya_patches(["show", "cpu.nope"])


# --- startup.compile_helpers ---------------------------------------------------------------------


def test_compile_helpers_is_replaced_by_an_import_check(monkeypatch):
    from megatron.core.datasets import utils

    from megatron_zaya.patches import startup

    apply_patches("startup.compile_helpers", log=lambda line: None)
    assert utils.compile_helpers is startup.check_prebuilt_helpers
    utils.compile_helpers()  # the wheel's helpers_cpp imports: no make, no exit

    monkeypatch.setattr(startup, "HELPERS_MODULE", "megatron.core.datasets.no_such_helpers")
    with pytest.raises(RuntimeError, match=r"dataset helpers .* do not import: .*pip install --force-reinstall"):
        utils.compile_helpers()


def test_compile_helpers_patch_steps_aside_for_a_source_install(tmp_path, monkeypatch):
    from megatron_zaya.patches import startup

    monkeypatch.setattr(startup, "_datasets_dir", lambda: tmp_path)
    assert startup._makefile_present() is None
    (tmp_path / "Makefile").write_text("all:\n")
    assert "Makefile" in startup._makefile_present()
    assert importlib.import_module("megatron.core.datasets.helpers_cpp")  # what the check imports


def test_training_starts_with_set_up_objects_frozen(monkeypatch):
    """``training_loop.frozen_setup_objects``: Megatron's ``train`` starts after a collection, with the objects
    that set-up left frozen, so that no later collection walks them."""
    import gc
    import weakref

    import megatron.training.training as training

    from megatron_zaya.patches.training_loop import frozen_setup_objects

    class Node:
        pass

    cycle, kept = Node(), Node()
    cycle.self = cycle  # garbage only a collection frees
    freed = weakref.ref(cycle)
    del cycle
    seen = {}

    def train():
        seen["freed"] = freed() is None
        seen["kept walked"] = any(obj is kept for obj in gc.get_objects())

    monkeypatch.setattr(training, "train", train)
    gc.disable()  # no automatic collection between here and the call
    try:
        frozen_setup_objects()
        training.train()
    finally:
        gc.unfreeze()
        gc.enable()
    assert seen == {"freed": True, "kept walked": False}


# --- startup.compile_disabled --------------------------------------------------------------------

_IMPORT_MEGATRON = ("import sys; from megatron_zaya.pretrain import _before_megatron; _before_megatron(sys.argv[1:]); "
                    "import torch; from megatron.core.fusions import fused_bias_geglu; "
                    "print('torch._dynamo' in sys.modules, torch.compile.__module__, "
                    "hasattr(fused_bias_geglu.geglu, '_torchdynamo_orig_callable'))")


@pytest.mark.parametrize("patches, imports_dynamo", [([], False), (["--zaya-patches", "cpu"], True)],
                         ids=["selected", "left-out"])
def test_disabled_compile_is_applied_before_megatron_is_imported(patches, imports_dynamo):
    """Under ``TORCH_COMPILE_DISABLE=1`` zaya-pretrain's start replaces ``torch.compile`` before Megatron is imported:
    Megatron's fusions are their plain functions and ``torch._dynamo`` is never imported; a ``--zaya-patches``
    selection without the patch keeps torch's (which imports dynamo to return a wrapper)."""
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "1"}
    run = subprocess.run([sys.executable, "-c", _IMPORT_MEGATRON, *patches], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    expected = f"{imports_dynamo} {'torch' if imports_dynamo else 'megatron_zaya.patches.startup'} {imports_dynamo}"
    assert run.stdout.strip().splitlines()[-1] == expected, run.stdout


# --- startup.argument_help_once -------------------------------------------------------------------

_MEGATRON_HELP = """
import argparse, json
from megatron.training.arguments import add_megatron_arguments
from megatron_zaya.patches import apply_patches

def texts():
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    return sorted((action.dest, action.help or "") for action in parser._actions)

megatron = texts()
apply_patches("startup.argument_help_once")
print(json.dumps([megatron, texts(), texts()]))  # the second patched parser's texts come from what the first read
"""


def test_megatron_help_texts_read_once_are_the_texts_megatron_reads():
    run = subprocess.run([sys.executable, "-c", _MEGATRON_HELP], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    megatron, first, second = json.loads(run.stdout.strip().splitlines()[-1])
    assert first == second == megatron
    assert sum(bool(text) for _, text in megatron) > 300  # the dataclass fields' texts are there
