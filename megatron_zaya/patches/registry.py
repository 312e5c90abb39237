"""The patch-hook registry: every place where megatron-zaya replaces a symbol of Megatron-Core or torch.

ZAYA1 plugs into Megatron-Core through its spec system wherever a spec slot reaches. What a spec cannot
reach (CUDA-only calls on a CPU machine, a start-up bug of the wheel, a fused kernel swapped in for a
Megatron default) is changed here, through a *patch*: a function registered with

* an ``id`` (``group.name``) and a ``group``, both usable in a selection;
* the ``target``: the dotted path of the symbol it replaces;
* the ``platforms`` it is meant for (``cpu``, ``cuda``, ``rocm``) and the Megatron-Core versions it was
  written against (``megatron``, a PEP 440 specifier);
* ``kernel=True`` for kernel swaps: a kernel patch asked for by name that cannot apply is an error;
* ``wraps``: the ids of the patches of the same target that it wraps (it applies after them). Patches of one
  target must be ordered this way, each pair of them, or resolving a selection fails;
* a docstring saying what it replaces, why, and how to turn it off.

A library call that applies patches (``load_pretrained``) leaves torch as it found it: within
:func:`torch_as_it_was`, the patches of torch itself that the block applied are undone at its end.

Selection: ``--zaya-patches all|none|<id or group>[,...]`` on the CLI, or the ``ZAYA_PATCHES`` environment
variable elsewhere (default ``all``: every patch whose platform and version conditions hold). The selected
patches apply in registration order (module by module, as ``_load_patch_modules`` lists them) except that a patch
applies after those it ``wraps``, so patches of one target nest as declared whatever the selection's order.
Applying is idempotent, and rank 0 logs one line per patch (applied or skipped, with the reason).
``zaya-patches list`` prints the table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import logging
import os
from collections.abc import Callable, Iterable

from ..errors import PatchError

logger = logging.getLogger("megatron_zaya.patches")

PLATFORMS = ("cpu", "cuda", "rocm")
ENV_VAR = "ZAYA_PATCHES"


@dataclasses.dataclass(frozen=True)
class Patch:
    id: str
    group: str
    target: str
    platforms: tuple[str, ...]
    megatron: str
    kernel: bool
    fn: Callable[[], None]
    requires: Callable[[], str | None] | None = None
    wraps: tuple[str, ...] = ()

    @property
    def doc(self) -> str:
        return inspect.cleandoc(self.fn.__doc__ or "")

    @property
    def summary(self) -> str:
        return self.doc.splitlines()[0] if self.doc else ""


REGISTRY: dict[str, Patch] = {}
_APPLIED: set[str] = set()
_REPLACED: dict[str, list[tuple[object, str, object, bool]]] = {}  # patch id -> its replace_attr calls, in order
_APPLYING: list[str] = []  # the patch whose function runs now


def register(
    id: str,
    *,
    target: str,
    platforms: Iterable[str] = PLATFORMS,
    megatron: str = "==0.19.2",
    kernel: bool = False,
    requires: Callable[[], str | None] | None = None,
    wraps: Iterable[str] = (),
):
    """Decorator: register ``fn`` as patch ``id`` (``group.name``). ``requires`` returns a reason to skip;
    ``wraps`` names the patches of the same target that this one wraps."""
    group = id.split(".", 1)[0]
    platforms = tuple(platforms)
    assert set(platforms) <= set(PLATFORMS), platforms

    def decorate(fn: Callable[[], None]) -> Callable[[], None]:
        if not (fn.__doc__ or "").strip():
            raise PatchError(f"patch {id} needs a docstring saying what it replaces, why, and how to turn it off")
        REGISTRY[id] = Patch(id, group, target, platforms, megatron, kernel, fn, requires, tuple(wraps))
        return fn

    return decorate


def current_platform() -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return "rocm" if getattr(torch.version, "hip", None) else "cuda"


def megatron_version() -> str:
    from importlib.metadata import version

    return version("megatron-core")


def fused_adam_present() -> str | None:
    """A ``requires`` condition for patches of Megatron's torch-Adam fallback: the reason to skip them where
    Transformer Engine or apex provides FusedAdam (Megatron then uses that, not torch's Adam), else None."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return "Transformer Engine or apex provides FusedAdam, which Megatron uses instead of torch's Adam"
    return None


def _version_ok(spec: str) -> bool:
    from packaging.specifiers import SpecifierSet

    return megatron_version() in SpecifierSet(spec)


def _load_patch_modules() -> None:
    for name in ("startup", "cpu", "kernels", "optim", "megatron_fixes", "pipeline", "reliability", "checkpointing",
                 "training_loop", "launch"):
        importlib.import_module(f"{__package__}.{name}")


def _wrapped(patch: Patch) -> set[str]:
    """The ids of the patches ``patch`` wraps, directly or through others."""
    found, todo = set(), list(patch.wraps)
    while todo:
        inner = todo.pop()
        if inner not in found and inner in REGISTRY:
            found.add(inner)
            todo += REGISTRY[inner].wraps
    return found


def check_nesting() -> None:
    """Raise :class:`PatchError` unless every two patches of one target declare which wraps the other."""
    by_target: dict[str, list[Patch]] = {}
    for patch in REGISTRY.values():
        by_target.setdefault(patch.target, []).append(patch)
        for inner in patch.wraps:
            if inner not in REGISTRY or REGISTRY[inner].target != patch.target:
                raise PatchError(f"patch {patch.id} wraps {inner!r}, which is no patch of its target {patch.target}")
        if patch.id in _wrapped(patch):
            raise PatchError(f"patch {patch.id} wraps itself through {', '.join(sorted(_wrapped(patch)))}")
    for target, patches in by_target.items():
        for i, outer in enumerate(patches):
            for inner in patches[i + 1:]:
                if inner.id not in _wrapped(outer) and outer.id not in _wrapped(inner):
                    raise PatchError(f"patches {outer.id} and {inner.id} both wrap {target} without a declared order; "
                                     "name the one inside in the other's wraps=(...)")


def _in_nesting_order(patches: list[Patch]) -> list[Patch]:
    """``patches`` in registration order, those of one target reordered among themselves so that each comes
    after the ones it wraps."""
    order = list(REGISTRY.values())
    patches = sorted(patches, key=order.index)
    by_target: dict[str, list[int]] = {}
    for slot, patch in enumerate(patches):
        by_target.setdefault(patch.target, []).append(slot)
    for slots in by_target.values():
        nested = sorted((patches[slot] for slot in slots), key=lambda patch: len(_wrapped(patch)))
        for slot, patch in zip(slots, nested):
            patches[slot] = patch
    return patches


def resolve(selection: str | None) -> tuple[list[Patch], set[str]]:
    """The patches a selection names, in the order they apply, and the subset named explicitly (by id or group,
    not via ``all``)."""
    _load_patch_modules()
    check_nesting()
    selection = (selection if selection is not None else os.environ.get(ENV_VAR, "all")).strip() or "all"
    if selection == "none":
        return [], set()
    if selection == "all":
        return _in_nesting_order(list(REGISTRY.values())), set()
    chosen: list[Patch] = []
    for token in (t.strip() for t in selection.split(",") if t.strip()):
        if token == "all":
            matches = list(REGISTRY.values())
        else:
            matches = [p for p in REGISTRY.values() if token in (p.id, p.group)]
        if not matches:
            known = ", ".join(sorted({p.group for p in REGISTRY.values()} | set(REGISTRY)))
            raise PatchError(f"unknown patch or group {token!r} in --zaya-patches; known: all, none, {known}")
        chosen += [p for p in matches if p not in chosen]
    chosen = _in_nesting_order(chosen)
    explicit = {p.id for p in chosen} if "all" not in selection.split(",") else set()
    return chosen, explicit


def check_selection(selection: str | None, needs_cpu_group: bool) -> None:
    """Raise :class:`PatchError` unless ``selection`` names known patches and, where Megatron's training is to
    run without a GPU (``needs_cpu_group``), every patch of the ``cpu`` group, without which it fails."""
    chosen, _ = resolve(selection)
    missing = [p.id for p in REGISTRY.values() if p.group == "cpu" and p not in chosen]
    if needs_cpu_group and missing:
        given = f"--zaya-patches {selection}" if selection is not None else f"{ENV_VAR}={os.environ.get(ENV_VAR)}"
        listed = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise PatchError(f"{given} leaves out {len(missing)} patches of the cpu group ({listed}), which Megatron's "
                         "training needs on a machine without a GPU; add cpu to the selection, or give all")


def skip_reason(patch: Patch, platform: str | None = None) -> str | None:
    platform = platform or current_platform()
    if platform not in patch.platforms:
        return f"platform is {platform}, patch is for {'/'.join(patch.platforms)}"
    if not _version_ok(patch.megatron):
        return f"megatron-core {megatron_version()} is outside {patch.megatron}"
    if patch.requires is not None:
        return patch.requires()
    return None


def apply_patches(selection: str | None = None, *, log: Callable[[str], None] | None = None) -> dict[str, str]:
    """Apply the selected patches once each; return ``{id: 'applied' | 'already applied' | 'skipped: why'}``."""
    patches, explicit = resolve(selection)
    log = log or _rank0_info
    report: dict[str, str] = {}
    for patch in patches:
        if patch.id in _APPLIED:
            report[patch.id] = "already applied"
            continue
        reason = skip_reason(patch)
        if reason is not None:
            if patch.kernel and patch.id in explicit:
                raise PatchError(f"kernel patch {patch.id} was asked for but cannot apply: {reason}")
            report[patch.id] = f"skipped: {reason}"
        else:
            _REPLACED[patch.id] = []
            _APPLYING.append(patch.id)
            try:
                patch.fn()
            finally:
                _APPLYING.pop()
            _APPLIED.add(patch.id)
            report[patch.id] = "applied"
        log(f"[zaya-patches] {patch.id:32s} {report[patch.id]}  ({patch.target})")
    return report


def applied() -> frozenset[str]:
    return frozenset(_APPLIED)


@contextlib.contextmanager
def torch_as_it_was():
    """At the end of the block, undo the patches of torch itself (targets ``torch.*``, process-wide) that were
    applied within it, so that a library call leaves the caller's torch as it was; patches of Megatron stay
    (what the built model runs on the CPU needs them). An undone patch applies again when next selected."""
    before = set(_APPLIED)
    try:
        yield
    finally:
        undone = [p.id for p in _in_nesting_order(list(REGISTRY.values()))
                  if p.id in _APPLIED - before and p.target.startswith("torch.")]
        for patch_id in reversed(undone):
            for owner, name, old, owned in reversed(_REPLACED.pop(patch_id)):
                if owned:
                    setattr(owner, name, old)
                else:  # inherited (``Tensor.cuda`` is ``TensorBase.cuda``): inherit it again
                    delattr(owner, name)
            _APPLIED.discard(patch_id)


def _rank0_info(message: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info(message)


def replace_attr(owner: object, name: str, new: object) -> object:
    """Replace ``owner.name`` by ``new`` and return the old value; fail loudly when the target is gone."""
    if not hasattr(owner, name):
        raise PatchError(
            f"{getattr(owner, '__name__', owner)}.{name} no longer exists: megatron-core changed under this patch "
            f"(written for megatron-core 0.19.2, found {megatron_version()})"
        )
    old = getattr(owner, name)
    if _APPLYING:
        _REPLACED[_APPLYING[-1]].append((owner, name, old, name in getattr(owner, "__dict__", {})))
    setattr(owner, name, new)
    return old
