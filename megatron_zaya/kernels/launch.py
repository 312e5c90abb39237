"""Launch a Triton kernel with less host time than ``kernel[grid](...)``: the compiled kernel's launcher, called
straight from a cache keyed by what Triton specializes on.

``kernel[grid](*args)`` binds the arguments, specializes each one (type, 16-byte alignment, integers equal to 1
or divisible by 16), hashes that into a cache key and builds launch metadata for hooks, before the launcher runs:
tens of microseconds a launch in Python, where the layer makes dozens of launches per step and the host, not
the GPU, sets the eager step's pace. :func:`launch` keys its own cache with a tuple at least as fine as Triton's
specialization (a tensor's dtype and alignment, and on ROCm whether its storage fits 2 GiB; an integer's range,
and whether it is 1 or a multiple of 16; other scalars by type; compile-time constants and options by value), so
two calls with one key run the same compiled kernel. A key's first call goes through ``kernel[grid](...)``,
which compiles and launches, and leaves its compiled kernel in the cache; later calls pass the launcher their
arguments, each tensor as its device address (read once, for the key's alignment too): the launcher then skips its
own ``data_ptr()`` call and its driver query per tensor (``cuPointerGetAttribute``, ``hipPointerGetAttribute``),
which the key's device check replaces.

It takes the ordinary path, every time, for interpreted kernels (``TRITON_INTERPRET=1``), for arguments it
cannot key (anything but tensors, numbers, booleans and ``None``), for a grid given as a function, and while
Triton's launch hooks or the kernel's pre-run hooks are set (profilers such as Proton set them). Triton's
``knobs.runtime.debug`` is read when a key is first compiled. tests/unit/test_triton_launch.py checks the key
against Triton's own binder.
"""

from __future__ import annotations

import contextlib

import torch
from triton import knobs
from triton.runtime import JITFunction, driver

_INT32 = range(-(2**31), 2**31)
_UNSIGNED_64 = 2**63
_WITHIN_2GB = 2**31 - 1  # the ROCm backend's buffer-operation specialization
_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter


class _Unkeyable(Exception):
    """An argument :func:`launch` has no key for: the call takes Triton's own path."""


class _Plan:
    """What :func:`launch` needs of one kernel: its parameters in order, their defaults, which are constants,
    and the compiled kernels by key."""

    def __init__(self, kernel: JITFunction):
        self.names = tuple(p.name for p in kernel.params)
        self.positions = {name: i for i, name in enumerate(self.names)}
        self.defaults = tuple(p.default if p.has_default else _MISSING for p in kernel.params)
        self.constant = tuple(p.is_constexpr for p in kernel.params)
        self.rocm = torch.version.hip is not None
        self.compiled: dict[tuple, tuple] = {}


_MISSING = object()
_PLANS: dict[int, _Plan] = {}
_direct = True  # False within :func:`through_triton`


@contextlib.contextmanager
def through_triton():
    """Within: every launch takes Triton's path, ``kernel[grid](...)`` (the benchmarks' same-process baseline)."""
    global _direct
    _direct = False
    try:
        yield
    finally:
        _direct = True


def _hooks_set(kernel: JITFunction) -> bool:
    """Whether a hook must see this launch: the kernel's pre-run hooks, or Triton's launch hooks (``None`` or an
    empty ``HookChain`` when unset, by Triton version)."""
    if kernel.pre_run_hooks:
        return True
    runtime = knobs.runtime
    return any(hook is not None and getattr(hook, "calls", True) for hook in (runtime.launch_enter_hook,
                                                                               runtime.launch_exit_hook))


def _rocm_tensor_key(value: torch.Tensor, address: int) -> tuple:
    return value.dtype, address & 15 == 0, value.is_cuda, value.untyped_storage().size() <= _WITHIN_2GB


def _scalar_key(value):
    """The key of an argument neither an integer nor a tensor: booleans by value, floats and ``None`` by kind."""
    kind = type(value)
    if kind is bool:
        return kind, value
    if kind is float or value is None:
        return kind
    raise _Unkeyable(kind.__name__)


def _bind(plan: _Plan, args: tuple, kwargs: dict) -> tuple[list, tuple]:
    """The kernel's arguments in parameter order (defaults filled in), and the launch options (keyword arguments
    that are no parameter, e.g. ``num_warps``) as a key."""
    if len(args) > len(plan.names):
        raise _Unkeyable("too many arguments")
    values = list(args) + [_MISSING] * (len(plan.names) - len(args))
    options = []
    for name, value in kwargs.items():
        position = plan.positions.get(name)
        if position is None:
            options.append((name, value))
        else:
            values[position] = value
    for i, value in enumerate(values):
        if value is _MISSING:
            if plan.defaults[i] is _MISSING:
                raise _Unkeyable(f"missing {plan.names[i]}")
            values[i] = plan.defaults[i]
    return values, tuple(options)


def key_and_arguments(plan: _Plan, values: list, options: tuple) -> tuple[tuple, list]:
    """The cache key of one launch and the launcher's arguments: ``values``, changed in place, each tensor
    replaced by its device address. The key holds each constant's value and what Triton's specialization of each
    other argument depends on (or finer): an integer's range, and whether it is 1 or a multiple of 16; a tensor's
    dtype and alignment, whether it is on a GPU (a host tensor then takes Triton's path, which refuses it) and on
    ROCm whether its storage fits 2 GiB; other scalars by :func:`_scalar_key`. No two kinds' keys are equal.
    Integers and tensors are keyed inline: this runs at every launch."""
    key = [options]
    rocm = plan.rocm
    for i, constant in enumerate(plan.constant):
        value = values[i]
        if constant:
            key.append(value)
            continue
        kind = type(value)
        if kind is int:
            key.append((value == 1, value & 15 == 0, value in _INT32, value < _UNSIGNED_64))
        elif kind is _TENSOR or kind is _PARAMETER or isinstance(value, _TENSOR):
            address = values[i] = value.data_ptr()
            key.append(_rocm_tensor_key(value, address) if rocm else (value.dtype, address & 15 == 0, value.is_cuda))
        else:
            key.append(_scalar_key(value))
    return tuple(key), values


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, through the compiled kernel's launcher once this key has been compiled."""
    if not _direct or not isinstance(kernel, JITFunction) or not isinstance(grid, tuple) or _hooks_set(kernel):
        kernel[grid](*args, **kwargs)
        return
    plan = _PLANS.get(id(kernel))
    if plan is None:
        plan = _PLANS[id(kernel)] = _Plan(kernel)
    try:
        values, options = _bind(plan, args, kwargs)
        device = driver.active.get_current_device()
        key, arguments = key_and_arguments(plan, values, options)
        key = (device, key)
    except (_Unkeyable, TypeError):  # TypeError: an unhashable constant
        kernel[grid](*args, **kwargs)
        return
    found = plan.compiled.get(key)
    if found is None:
        compiled = kernel[grid](*args, **kwargs)
        if compiled is not None and hasattr(compiled, "packed_metadata"):  # None: compiled elsewhere, not run
            runner = compiled.run  # (loads the binary on first access)
            plan.compiled[key] = (runner, compiled.function, compiled.packed_metadata)
        return
    runner, function, metadata = found
    stream = driver.active.get_current_stream(device)
    runner(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream, function, metadata,
           None, None, None, *arguments)
