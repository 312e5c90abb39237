"""``kernels.launch``: its cache key separates every pair of calls that Triton's own binder specializes
differently, for CUDA and ROCm targets, so a call never runs a kernel compiled for other arguments. The launch
itself runs on GPUs (tests/gpu/test_kernels_gpu.py); on CPU the kernels are interpreted and take Triton's path.
"""

import random

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.jit import create_function_from_signature

from megatron_zaya.kernels import launch as direct


@triton.jit
def _probe(x_ptr, y_ptr, n, stride, scale, flag, maybe, BLOCK: tl.constexpr, MODE: tl.constexpr = 2):
    pass


def _arguments():
    """Values for each argument that Triton specializes differently (or alike, to test the key is not coarser)."""
    whole = torch.empty(64, dtype=torch.float32)
    over_2gib = torch.empty(2**29 + 64, dtype=torch.float32)  # (virtual memory only: never written)
    tensors = [whole, whole[1:], whole[4:], whole.to(torch.bfloat16), whole.to(torch.bfloat16)[3:], over_2gib,
               over_2gib[4:], torch.nn.Parameter(whole[4:])]
    integers = [0, 1, 2, 16, 17, -16, -1, 2**31 - 16, 2**31 - 1, 2**31, -(2**31), -(2**31) - 16, 2**40, 2**63 - 16,
                2**63, 2**64 - 16]
    return {
        "x_ptr": tensors, "y_ptr": tensors[:4], "n": integers, "stride": integers[:6], "scale": [0.5, 2.0, 1, 16],
        "flag": [True, False, 1, 0], "maybe": [None, 7, 32], "BLOCK": [16, 32], "MODE": [None, 2, 3],
        "num_warps": [None, 4, 8],
    }  # fmt: skip


def _calls(count: int):
    """Calls as (args, kwargs): one argument varied at a time from a base, then random combinations."""
    values, rng = _arguments(), random.Random(0)
    base = {name: options[0] for name, options in values.items()}
    picks = [dict(base, **{name: option}) for name, options in values.items() for option in options]
    picks += [{name: rng.choice(options) for name, options in values.items()} for _ in range(count)]
    for pick in picks:
        args = [pick[name] for name in ("x_ptr", "y_ptr", "n", "stride", "scale", "flag", "maybe")]
        kwargs = {"BLOCK": pick["BLOCK"]}
        kwargs.update({name: pick[name] for name in ("MODE", "num_warps") if pick[name] is not None})
        yield args, kwargs


@pytest.mark.parametrize("target", [GPUTarget("cuda", 90, 32), GPUTarget("hip", "gfx942", 64)], ids=["sm_90", "gfx942"])
def test_the_key_is_at_least_as_fine_as_triton_specialization(target):
    binder = create_function_from_signature(_probe.signature, _probe.params, make_backend(target))
    plan = direct._Plan(_probe)
    plan.rocm = target.backend == "hip"
    triton_by_key, keys = {}, set()
    for args, kwargs in _calls(400):
        values, options = direct._bind(plan, args, kwargs)
        bound, specialization, triton_options = binder(*args, **kwargs)
        assert values == list(bound.values())  # the arguments Triton would pass
        key, arguments = direct.key_and_arguments(plan, values, options)
        by_triton = (str(specialization), sorted(triton_options.items()))
        assert triton_by_key.setdefault(key, by_triton) == by_triton, (args, kwargs)
        keys.add(str(by_triton))
        assert arguments == [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in bound.values()]
    assert len(keys) > 100  # the calls do cover many specializations


def test_arguments_without_a_key_take_tritons_path():
    plan = direct._Plan(_probe)
    with pytest.raises(direct._Unkeyable):
        direct.key_and_arguments(plan, *direct._bind(plan, [(1, 2)] + [0] * 6, {"BLOCK": 16}))
    with pytest.raises(direct._Unkeyable):  # a missing argument: Triton's path reports it
        direct._bind(plan, [0] * 6, {"BLOCK": 16})
