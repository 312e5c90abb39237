"""Test support for the Triton kernels (megatron_zaya/kernels): run them on CPU (interpreter), compile them for
GPUs without one.

Loading. triton 3.8 reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a function: for our kernels
when their module is imported, for triton's library functions (``tl.sum``, ``tl.max``, ...) when triton is
imported. Once anything in the process has imported triton compiled (``import megatron.core`` does), an
interpreted kernel calling ``tl.sum`` fails, and the reverse holds too. ``load_kernel_module`` therefore
imports a kernel module against a private copy of triton's Python modules, loaded with
``TRITON_INTERPRET`` set as asked (the compiled extension ``triton._C`` is shared), then puts
``sys.modules``, the package attributes and the environment back. Because triton also imports lazily
inside its functions, the private copy is put back into ``sys.modules`` for the duration of each launch
of the module's kernels (and of a ``compile_only`` block). Other tests in the process are unaffected,
whatever they imported first.

Interpreter limits. It computes in numpy and stores bfloat16 as raw uint16 bits, so bf16 arithmetic and
bf16 ``tl.dot`` are wrong there (triton-lang/triton#11584, #4972). Our kernels upcast to fp32 right after
every load (as they do on GPUs); kernels built on ``tl.dot`` are tested with fp32/fp16 on CPU and bf16 on
GPUs (tests/gpu/test_kernels_gpu.py).

Compiling. ``compile_only(module, target)`` makes every launch compile for a ``GPUTarget`` (sm_90,
gfx942, ...) and return without running, so CPU tests catch compile errors, register spills and shared
memory overflows on both vendors.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from types import ModuleType

import torch

_PACKAGE = "megatron_zaya.kernels"


def _is_triton_python(name: str) -> bool:
    return (name == "triton" or name.startswith("triton.")) and not name.startswith("triton._C")


def _private(name: str) -> bool:
    """Modules a private load re-imports: triton's Python side and our kernel modules."""
    return _is_triton_python(name) or name.startswith(_PACKAGE + ".")


@contextlib.contextmanager
def _interpret_env(interpret: bool) -> Iterator[None]:
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


@contextlib.contextmanager
def _triton_installed(module: ModuleType) -> Iterator[None]:
    """Within: ``import triton...`` resolves to ``module``'s private copy (triton imports inside functions)."""
    private = module.private_triton_modules
    displaced = {name: sys.modules.pop(name) for name in list(sys.modules) if _is_triton_python(name)}
    sys.modules.update(private)
    try:
        with _interpret_env(module.triton_interpreted):
            yield
    finally:
        private.update({name: sys.modules.pop(name) for name in list(sys.modules) if _is_triton_python(name)})
        sys.modules.update(displaced)


def _run_with_private_triton(kernel, module: ModuleType) -> None:
    launch = kernel.run

    def run(*args, **kwargs):
        with _triton_installed(module):
            return launch(*args, **kwargs)

    kernel.run = run


def _patch_lang_once_per_launch(interpreter: ModuleType) -> None:
    """Make the interpreter patch ``triton.language`` for a module's ``@triton.jit`` functions once per launch,
    not again at every call of a helper.

    A launch patches the language's builtins that its kernel's module sees for its duration
    (``GridExecutor.__call__`` calls ``_patch_lang`` and restores it after); triton 3.8 patches them again, never
    restored, at each call of a helper (``InterpretedFunction.__call__``), once per program instance. Each time
    lists the members of four modules and wraps every builtin, already wrapped, in another layer, so a kernel
    calling helpers got slower with every program: a layer step's launch-count test made 55,997 such patches and
    took 135 s in CI, 67 s without them. Here
    a helper's call patches only for the first function of its module (``triton.language.standard``'s see
    ``core``, which the kernel's may not) in a launch, and the launch's end restores those patches too."""
    original = interpreter._patch_lang
    launch: dict[int, object] = {}  # the launch's patch scopes by the patched function's module (its globals)

    def patch_lang(fn):
        if launch:  # a helper's call inside a launch
            if id(fn.__globals__) not in launch:
                launch[id(fn.__globals__)] = original(fn)
            return interpreter._LangPatchScope()  # nothing for the helper's caller to restore
        scope = original(fn)
        restore = scope.restore

        def restore_all():
            for helper_scope in reversed([s for s in launch.values() if s is not scope]):
                helper_scope.restore()
            launch.clear()
            restore()

        scope.restore = restore_all
        launch[id(fn.__globals__)] = scope
        return scope

    interpreter._patch_lang = patch_lang


def load_kernel_module(module_name: str, *, interpret: bool = True) -> ModuleType:
    """A private import of ``module_name`` with its kernels interpreted (CPU) or compiled (see compile_only)."""
    package = importlib.import_module(_PACKAGE)
    saved_modules = {name: sys.modules.pop(name) for name in list(sys.modules) if _private(name)}
    saved_package = dict(vars(package))
    try:
        with _interpret_env(interpret):
            module = importlib.import_module(module_name)
    finally:
        private = {name: sys.modules.pop(name) for name in list(sys.modules) if _private(name)}
        sys.modules.update(saved_modules)
        vars(package).clear()
        vars(package).update(saved_package)
    module.private_triton_modules = {name: m for name, m in private.items() if _is_triton_python(name)}
    module.triton_interpreted = interpret
    kernel_types = ("InterpretedFunction", "JITFunction")
    kernels = [value for value in vars(module).values() if type(value).__name__ in kernel_types]
    kind = "InterpretedFunction" if interpret else "JITFunction"
    if not kernels or any(type(kernel).__name__ != kind for kernel in kernels):
        raise RuntimeError(f"{module_name}: expected its Triton kernels to load as {kind}s")
    if interpret:
        _patch_lang_once_per_launch(module.private_triton_modules["triton.runtime.interpreter"])
        for kernel in kernels:
            _run_with_private_triton(kernel, module)
    return module


def assert_matches_oracle(name: str, actual, oracle, reference=None, rel_tol: float = 1e-5) -> None:
    """Assert ``actual`` is as close to the float64 ``oracle`` as the eager torch ``reference`` is.

    Error is the largest absolute difference. The bound is twice the reference's own error (both round to
    the same low-precision outputs, in different orders) or, if larger, the oracle's magnitude times
    ``rel_tol`` or two units of ``actual``'s precision; a wrong kernel misses it by orders of magnitude.
    """
    if actual.shape != oracle.shape:
        raise AssertionError(f"{name}: shape {list(actual.shape)} != oracle shape {list(oracle.shape)}")
    oracle = oracle.double()
    error = (actual.double() - oracle).abs().max().item()
    scale = oracle.abs().max().item()
    bound = max(rel_tol, 2 * torch.finfo(actual.dtype).eps) * max(scale, 1e-30)
    if reference is not None:
        bound = max(bound, 2 * (reference.double() - oracle).abs().max().item())
    if not error <= bound or not torch.isfinite(actual).all():
        raise AssertionError(f"{name}: max error {error:.3g} vs float64 exceeds {bound:.3g} (|oracle| max {scale:.3g})")



def assert_weight_grads_match(weights, before, returned, oracle, into_main_grad: bool) -> None:
    """The experts' weight gradients against their float64 ``oracle`` [E, M, K]: added into each weight's
    ``main_grad`` (which held ``before``) and the weight marked as Megatron's hooks expect, when
    ``into_main_grad``; else ``returned`` by autograd, ``main_grad`` untouched."""
    for e, weight in enumerate(weights):
        assert weight.grad_added_to_main_grad == into_main_grad
        if into_main_grad:
            assert_matches_oracle(f"main_grad[{e}]", weight.main_grad - before[e], oracle[e])
        else:
            assert torch.equal(weight.main_grad, before[e])
            assert_matches_oracle(f"d_weight[{e}]", returned[e], oracle[e])

class _CompileOnlyDriver:
    """Stands in for triton's GPU driver: reports ``target`` so launches specialise for it without a GPU."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return f"compile-only:{self.target.backend}:{self.target.arch}"  # kernels cache their backend per device

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


@contextlib.contextmanager
def compile_only(module: ModuleType, target) -> Iterator[list]:
    """Within: launches of ``module``'s kernels compile for ``target`` (a ``GPUTarget``) and do not run.

    ``module`` comes from ``load_kernel_module(..., interpret=False)``. Host code runs for real (give it meta
    tensors), so the specialisations are those a GPU run compiles. Yields the list of compiled kernels,
    one per distinct specialisation.
    """
    triton = module.triton
    compiled, seen = [], set()

    def compile_instead_of_run(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        if (fn.jit_function, key) in seen:  # launches with the same specialisation compile once
            return True
        seen.add((fn.jit_function, key))
        options = json.loads(compile["specialization_data"])["options"]
        options = {name: tuple(v) if isinstance(v, list) else v for name, v in options.items()}  # JSON made lists
        source = triton.compiler.ASTSource(fn.jit_function, compile["signature"], compile["constants"],
                                           compile["configs"][0])  # fmt: skip
        compiled.append(triton.compile(source, target=target, options=options))
        return True  # the launcher then returns without running anything

    driver, previous_driver = triton.runtime.driver, triton.runtime.driver._active
    triton.knobs.runtime.jit_cache_hook = compile_instead_of_run
    driver.set_active(_CompileOnlyDriver(target))
    try:
        with _triton_installed(module):
            yield compiled
    finally:
        triton.knobs.runtime.jit_cache_hook = None
        driver._active = previous_driver


# Shared memory a kernel may use per block on each compile target (H100/H200, MI300X).
SHARED_LIMIT = {"sm_90": 227 * 1024, "gfx942": 64 * 1024}


def gpu_target(name: str, triton):
    """The ``GPUTarget`` of ``"sm_90"`` or ``"gfx942"`` in the (private) ``triton`` a kernel module was loaded with."""
    GPUTarget = triton.backends.compiler.GPUTarget
    return {"sm_90": GPUTarget("cuda", 90, 32), "gfx942": GPUTarget("hip", "gfx942", 64)}[name]


def register_spills(kernel, target_name: str, triton) -> int:
    """Registers a compiled kernel spills to local memory (cuobjdump's LOCAL on sm_90, spill counts on gfx942)."""
    if target_name == "sm_90":
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(kernel.asm["cubin"])
            cubin.flush()
            usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-res-usage", cubin.name],
                                   capture_output=True, text=True, check=True).stdout  # fmt: skip
        return sum(int(n) for n in re.findall(r"LOCAL:(\d+)", usage))
    return sum(int(n) for n in re.findall(r"\.[sv]gpr_spill_count:\s+(\d+)", kernel.asm["amdgcn"]))


def install(monkeypatch, module: ModuleType) -> None:
    """For the test: ``megatron_zaya.ops`` imports ``module`` (from :func:`load_kernel_module`) as its kernel."""
    name = module.__name__
    monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(importlib.import_module(_PACKAGE), name.rsplit(".", 1)[1], module, raising=False)


# The kernel modules the model's ops call (off a GPU, without the interpreter, the ops compute their references).
MODEL_KERNELS = ("cca", "cross_entropy", "grouped_gemm", "residual_rmsnorm", "router", "sort_by_expert", "swiglu")


def load_model_kernels() -> dict[str, ModuleType]:
    """:data:`MODEL_KERNELS` loaded interpreted, by short name."""
    return {name: load_kernel_module(f"{_PACKAGE}.{name}") for name in MODEL_KERNELS}


# The grouped GEMM's interpreter settings in model-level tests: a test model's expert GEMM in a few tiles. The
# interpreter runs a kernel's programs one after another, and the kernel tests' 16-wide tiles (which they need:
# rows and columns past a tile's end) made the grouped GEMM 3/4 of a model test's time.
MODEL_TEST_GEMM = {"block_m": 32, "block_n": 64, "block_k": 64, "warps": 4, "stages": 1,
                   "wgrad_block_m": 64, "wgrad_block_n": 64, "wgrad_block_r": 32, "wgrad_warps": 4, "wgrad_stages": 1}


def install_model_kernels(monkeypatch, modules: dict[str, ModuleType], around_launch) -> None:
    """For the test: the model's ops import the interpreted ``modules`` (:func:`load_model_kernels`), and each
    launch of their kernels runs inside ``around_launch(module name, kernel name)``, a context manager. The
    grouped GEMM, where given, launches with :data:`MODEL_TEST_GEMM`."""
    if "grouped_gemm" in modules:
        monkeypatch.setitem(modules["grouped_gemm"].GEMM_TUNING, "cpu", MODEL_TEST_GEMM)
    for name, module in modules.items():
        install(monkeypatch, module)
        for kernel in (v for v in vars(module).values() if type(v).__name__ == "InterpretedFunction"):
            def run(*args, _launch=kernel.run, _names=(name, kernel.fn.__name__), **kwargs):
                with around_launch(*_names):
                    return _launch(*args, **kwargs)

            monkeypatch.setattr(kernel, "run", run)
