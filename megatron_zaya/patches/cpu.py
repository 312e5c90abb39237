"""Patch group ``cpu``: run Megatron-Core 0.19.2 model code and ``megatron.training.pretrain()`` on a
CPU-only machine with the gloo backend (unit tests, CI). Never applied where CUDA or ROCm is present.

Megatron reaches the GPU in three ways; each gets the narrowest replacement that covers it:

1. ``torch.cuda.current_device()`` (about 200 sites, mostly ``device=torch.cuda.current_device()``) and
   ``Tensor.cuda()``: replaced process-wide (``cpu.current_device``, ``cpu.tensor_cuda``). On a machine
   without CUDA the originals can only raise, so no code that works changes meaning. ``load_pretrained``
   undoes both when it returns (``registry.torch_as_it_was``); the model's forward needs neither.
2. ``device='cuda'`` literals and the other ``torch.cuda`` calls (streams, events, ``synchronize``, RNG
   state, ``device_count``) of a fixed list of Megatron modules: the module-global name ``torch`` of each
   is swapped for :data:`CPU_TORCH`, a view of torch in which the CUDA device is the CPU. Code outside
   those modules, torch included, keeps the real ``torch``. One patch per module says which sites it covers.
3. Call sites neither reaches (``initialize_megatron``'s CUDA assert, RNG tracker internals, a
   ``Tensor.type()`` assert, alltoall split sizes): one replacement each. The only TorchFunctionMode is
   the one ``cpu.clip_grads`` holds for the duration of one function, to answer ``Tensor.type()``.

Determinism: the "CUDA" generator is the CPU default generator (dropout on CPU tensors draws from it), so
RNG tracker states are CPU generator states and checkpoints save and restore them exactly.
``cpu.jit_warmup_rng`` and ``cpu.dataloader_rng`` keep draws that a GPU run makes from other generators
off that stream, so TP1 and TP2 start from the same weights and a resumed run replays dropout exactly.
Turn a patch off by leaving its id out of ``--zaya-patches`` / ``ZAYA_PATCHES`` (``none`` for all).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import time
import types

import torch

from ..errors import PatchError
from .registry import register, replace_attr

CPU = torch.device("cpu")
_FACTORIES = (
    "tensor as_tensor zeros ones empty full arange rand randn randint randperm eye linspace "
    "zeros_like ones_like empty_like full_like rand_like randn_like"
).split()


def _cpu_device(device):
    """Map a CUDA device (``'cuda'``, ``'cuda:1'``, ``torch.device('cuda')``, an int) to the CPU."""
    if isinstance(device, int) or (device is not None and torch.device(device).type == "cuda"):
        return CPU
    return device


def _on_cpu(factory):
    @functools.wraps(factory)
    def build(*args, device=None, pin_memory=False, **kwargs):
        return factory(*args, device=_cpu_device(device), **kwargs)  # pinning needs CUDA; nothing to pin for

    return build


class _CpuEvent:
    """``torch.cuda.Event`` on the CPU: a wall-clock timestamp; work is already complete when recorded."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self._time = None

    def record(self, stream=None):
        self._time = time.perf_counter()

    def elapsed_time(self, end_event) -> float:
        return (end_event._time - self._time) * 1000.0

    def query(self) -> bool:
        return True

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass


class _CpuStream:
    """``torch.cuda.Stream`` on the CPU: every CPU op is synchronous, so there is nothing to order."""

    def __init__(self, device=None, priority=0, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = event or _CpuEvent()
        event.record()
        return event

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True


_DEFAULT_STREAM = _CpuStream()


def _nothing(*args, **kwargs):
    return None


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` as seen by a patched Megatron module: one device, the CPU.

    Names not defined here fall through to the real ``torch.cuda`` (type names such as
    ``torch.cuda.FloatTensor`` work; an unhandled CUDA call raises exactly as before).
    """

    Event = _CpuEvent
    Stream = _CpuStream

    def __init__(self):
        super().__init__("torch.cuda")

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    current_device = staticmethod(lambda: CPU)
    device_count = staticmethod(lambda: 1)  # "one accelerator": initialize then seeds the RNG tracker
    set_device = synchronize = empty_cache = reset_peak_memory_stats = staticmethod(_nothing)
    current_stream = default_stream = staticmethod(lambda device=None: _DEFAULT_STREAM)
    stream = staticmethod(lambda stream=None: contextlib.nullcontext())
    memory_allocated = max_memory_allocated = memory_reserved = max_memory_reserved = staticmethod(
        lambda device=None: 0
    )
    # No CUDA architecture: Megatron's pre-Blackwell rules apply (TP>1 wants CUDA_DEVICE_MAX_CONNECTIONS=1).
    get_device_properties = staticmethod(lambda device=None: types.SimpleNamespace(name="cpu", major=0, minor=0))
    # The "CUDA" generator is the CPU default generator: CPU ops (dropout) draw from it.
    get_rng_state = staticmethod(lambda device="cuda": torch.get_rng_state())
    set_rng_state = staticmethod(lambda new_state, device="cuda": torch.set_rng_state(new_state))
    manual_seed = manual_seed_all = staticmethod(lambda seed: torch.default_generator.manual_seed(int(seed)))


class _CpuTorch(types.ModuleType):
    """``torch`` as seen by a patched Megatron module: ``device='cuda'`` means the CPU, ``torch.cuda`` is
    :class:`_CpuCuda`; everything else is the real ``torch``."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


CPU_TORCH = _CpuTorch()


def _see_cpu_torch(*module_names: str) -> None:
    """Swap the module-global ``torch`` of each named Megatron module for :data:`CPU_TORCH`."""
    for name in module_names:
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is not torch:
            raise PatchError(f"{name} has no module-global `torch` any more: megatron-core changed under this patch")
        replace_attr(module, "torch", CPU_TORCH)


def _cpu_patch(patch_id: str, target: str):
    """Register a ``cpu``-platform patch; its docstring gains the line saying how to turn it off."""

    def decorate(fn):
        off = f"Off: leave ``{patch_id}`` out of ``--zaya-patches`` / ``ZAYA_PATCHES``."
        fn.__doc__ = f"{inspect.cleandoc(fn.__doc__)}\n\n{off}"
        return register(patch_id, target=target, platforms=("cpu",))(fn)

    return decorate


# --- 1. process-wide: calls that can only raise on a machine without CUDA -------------------------


@_cpu_patch("cpu.current_device", "torch.cuda.current_device")
def patch_current_device() -> None:
    """Make ``torch.cuda.current_device()`` return ``torch.device('cpu')``, process-wide.

    Megatron allocates on ``torch.cuda.current_device()`` at about 200 sites, among them rotary
    embedding's ``inv_freq.to(device=...)`` (rotary_pos_embedding.py:162), the global memory buffer of
    DotProductAttention (core/utils.py:715), the router's buffers and gating (router.py:96-247), the
    TP/SP collectives' output buffers (tensor_parallel/mappings.py) and ``get_batch_on_this_tp_rank``'s
    receive buffers. Without CUDA the original raises "Found no NVIDIA driver", so no working code
    changes meaning; code that formats it as ``f'cuda:{...}'`` needs its own patch.
    """
    replace_attr(torch.cuda, "current_device", _CpuCuda.current_device)


def _tensor_to_cpu(tensor, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return tensor.to(CPU, non_blocking=non_blocking, memory_format=memory_format)


@_cpu_patch("cpu.tensor_cuda", "torch.Tensor.cuda")
def patch_tensor_cuda() -> None:
    """Make ``Tensor.cuda()`` (and so ``nn.Module.cuda()``) move to the CPU, process-wide.

    Sites: ``get_model`` / ``build_distributed_models`` move the built model with
    ``model.cuda(torch.cuda.current_device())`` (training.py:1818, models/dist_utils.py:174), and
    ``pretrain_gpt.py``-style ``get_batch`` moves each batch with ``.cuda(non_blocking=True)``. Without
    CUDA the original raises, so no working code changes meaning.
    """
    replace_attr(torch.Tensor, "cuda", _tensor_to_cpu)


# --- 2. initialisation and RNG -------------------------------------------------------------------


@_cpu_patch("cpu.initialize", "megatron.training.initialize.initialize_megatron")
def patch_initialize() -> None:
    """Let ``initialize_megatron`` run without CUDA: ``allow_no_cuda=True`` and a one-CPU-device view.

    ``pretrain()`` calls ``initialize_megatron`` without ``allow_no_cuda`` (training.py:1091), so it
    asserts ``torch.cuda.is_available()`` (initialize.py:66); the wrapper forces ``allow_no_cuda=True``
    (patched on ``megatron.training``, ``.initialize`` and ``.training``, which import the name).
    ``initialize.py`` also sees :data:`CPU_TORCH`: ``device_count()`` is 1, else it skips model-parallel
    init and RNG seeding (l.270, 358, 447), and ``set_device`` is a no-op (l.282).
    """
    import megatron.training
    from megatron.training import initialize, training

    original = initialize.initialize_megatron

    @functools.wraps(original)
    def initialize_megatron(allow_no_cuda=False, *args, **kwargs):
        return original(True, *args, **kwargs)

    for module in (megatron.training, initialize, training):
        replace_attr(module, "initialize_megatron", initialize_megatron)
    _see_cpu_torch("megatron.training.initialize")


@_cpu_patch("cpu.eager_fusions", "megatron.core.fusions.fused_bias_swiglu")
def patch_eager_fusions() -> None:
    """Run Megatron's ``torch.compile``'d elementwise fusions eagerly on a CPU host.

    ``@jit_fuser`` compiles the bias-SwiGLU (forward, backward, weighted) and bias-dropout-add functions of
    ``megatron.core.fusions.fused_bias_swiglu`` and ``.fused_bias_dropout``; on CPU, Inductor builds them
    with the host's C++ compiler at the JIT warm-up and the first step, about 5 s of every process start,
    for memory-bound chains that gain nothing from it there. Each compiled function is replaced by the
    function it wraps (``_torchdynamo_orig_callable``); callers look them up by module-global name. Nothing is
    left to replace where ``startup.compile_disabled`` applied first: the fusions are their functions already.
    """
    from megatron.core.fusions import fused_bias_dropout, fused_bias_swiglu

    from .registry import applied
    from .startup import COMPILE_DISABLED

    replaced = 0
    for module in (fused_bias_swiglu, fused_bias_dropout):
        for name, value in vars(module).copy().items():
            original = getattr(value, "_torchdynamo_orig_callable", None)
            if callable(value) and original is not None:
                replace_attr(module, name, original)
                replaced += 1
    if not replaced and COMPILE_DISABLED not in applied():
        raise PatchError("megatron.core.fusions compiles none of its fusions any more: megatron-core changed")


@_cpu_patch("cpu.jit_warmup_rng", "megatron.training.initialize._warmup_jit_function")
def patch_jit_warmup_rng() -> None:
    """Keep the CPU RNG stream where it was across the JIT warm-up, so weights do not depend on TP size.

    ``pretrain`` warms the fused bias-activation/dropout functions up on random "GPU" tensors whose sizes
    depend on the TP size (initialize.py:497-558). On a GPU they draw from the CUDA generator; on CPU
    (``cpu.initialize``) from the CPU generator, just before ``--use-cpu-initialization`` draws the
    weights from it, so TP1 and TP2 would start from different weights. The wrapper runs the warm-up
    inside ``torch.random.fork_rng(devices=[])`` (patched on ``megatron.training.initialize``, where
    ``set_jit_fusion_options`` looks it up).
    """
    from megatron.training import initialize

    original = initialize._warmup_jit_function

    @functools.wraps(original)
    def warmup_jit_function(*args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            return original(*args, **kwargs)

    replace_attr(initialize, "_warmup_jit_function", warmup_jit_function)


@_cpu_patch("cpu.rng", "megatron.core.tensor_parallel.random._get_cuda_rng_state")
def patch_rng() -> None:
    """Make Megatron's "CUDA" RNG the CPU default generator, so the RNG tracker works on CPU.

    The ``CudaRNGStatesTracker`` keeps one generator state per parallel axis and ``fork()`` swaps it
    into the CUDA generator around dropout and weight init. On CPU those ops draw from the CPU default
    generator, so ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` (random.py:104-175, which index
    ``torch.cuda.default_generators``) become ``torch.get_rng_state`` / ``torch.set_rng_state``, and
    random.py sees :data:`CPU_TORCH` (``torch.cuda.get_rng_state`` / ``manual_seed`` in ``add()`` and
    ``model_parallel_cuda_manual_seed``, l.303-306, 490). Consequence: ``model_parallel_cuda_manual_seed``
    reseeds the CPU generator with its data-parallel seed, as ``_set_random_seed`` already did, and
    ``fork()``'s warning that the CPU RNG changed inside a GPU RNG fork (l.332-333) is filtered out.
    """
    from megatron.core.tensor_parallel import random

    def get_cpu_rng_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_cpu_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    replace_attr(random, "_get_cuda_rng_state", get_cpu_rng_state)
    replace_attr(random, "_set_cuda_rng_state", set_cpu_rng_state)
    _see_cpu_torch("megatron.core.tensor_parallel.random")
    logging.getLogger(random.__name__).addFilter(_drop_cpu_rng_changed_warning)


def _drop_cpu_rng_changed_warning(record: logging.LogRecord) -> bool:
    # fork() warns when the CPU RNG moved inside a "GPU" RNG fork; here the two are one generator.
    return record.getMessage() != "CPU RNG state changed within GPU RNG context"


@_cpu_patch("cpu.dataloader_rng", "megatron.training.datasets.data_samplers.build_pretraining_data_loader")
def patch_dataloader_rng() -> None:
    """Give Megatron's training DataLoaders their own generator, so a resumed run replays dropout exactly.

    Each ``iter(DataLoader)`` draws a worker base seed from ``loader.generator``, by default the CPU
    default generator (torch/utils/data/dataloader.py:690). On a GPU that costs nothing, but on CPU the
    default generator is also the "CUDA" one that hidden dropout draws from (see ``cpu.rng``), and a
    resumed run builds its data iterators *after* restoring the RNG state from the checkpoint: one extra
    draw, and dropout masks differ from the uninterrupted run. The wrapped ``build_pretraining_data_loader``
    sets ``loader.generator = torch.Generator().manual_seed(args.seed)`` (patched in ``data_samplers``
    and in ``megatron.training.training``, which imports the name).
    """
    from megatron.training import get_args, training
    from megatron.training.datasets import data_samplers

    original = data_samplers.build_pretraining_data_loader

    @functools.wraps(original)
    def build_pretraining_data_loader(*args, **kwargs):
        loader = original(*args, **kwargs)
        if loader is not None:
            loader.generator = torch.Generator().manual_seed(get_args().seed)
        return loader

    for module in (data_samplers, training):
        replace_attr(module, "build_pretraining_data_loader", build_pretraining_data_loader)


# --- 3. Megatron modules that only need the CPU view of torch -------------------------------------


@_cpu_patch("cpu.training_loop", "megatron.training.training.torch")
def patch_training_loop() -> None:
    """Give ``megatron.training.training`` the CPU view of torch.

    Covers its ``device='cuda'`` tensors (start-time and exit-duration all-reduces l.1131-1137, 3297,
    loss dicts l.2613-2884, 4270, train/valid/test flags l.4588-4653), ``torch.cuda.empty_cache``,
    ``synchronize`` and memory stats.
    """
    _see_cpu_torch("megatron.training.training")


@_cpu_patch("cpu.model_wrapping", "megatron.training.models.dist_utils.torch")
def patch_model_wrapping() -> None:
    """Give ``megatron.training.models.dist_utils`` (``build_distributed_models``, the 0.19 model path of
    ``pretrain``) the CPU view of torch: the side stream it wraps DDP on (l.303) is a no-op."""
    _see_cpu_torch("megatron.training.models.dist_utils")


@_cpu_patch("cpu.checkpointing", "megatron.training.checkpointing.torch")
def patch_checkpointing() -> None:
    """Give ``megatron.training.checkpointing`` the CPU view of torch.

    Covers the iteration all-reduce on ``device='cuda'`` (l.375) and the ``cuda_rng_state`` it saves and
    restores (l.417, 2665-2677), which is then the CPU generator state, as ``cpu.rng`` makes it.
    """
    _see_cpu_torch("megatron.training.checkpointing")


@_cpu_patch("cpu.dist_checkpointing", "megatron.core.dist_checkpointing.strategies.filesystem_async.torch")
def patch_dist_checkpointing() -> None:
    """Give the ``torch_dist`` checkpoint strategies the CPU view of torch: ``torch.cuda.synchronize``
    before writing (filesystem_async.py:248, fully_parallel.py:287-296) and the ``device='cuda'``
    validation flags (state_dict_saver.py:204, 252)."""
    _see_cpu_torch(
        "megatron.core.dist_checkpointing.strategies.filesystem_async",
        "megatron.core.dist_checkpointing.strategies.fully_parallel",
        "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    )


@_cpu_patch("cpu.async_checkpoint_worker",
            "megatron.core.dist_checkpointing.strategies.async_utils.PersistentAsyncCaller._get_process")
def patch_async_checkpoint_worker() -> None:
    """Run Megatron's background checkpoint writer (``--async-save``) and ZAYA1's local tier on the CPU.

    * The persistent writer process is started with ``forkserver`` (initialize.py:74) or, once the run's end
      closed it, ``spawn`` (a save after training, async_utils.py:415): a fresh interpreter without these
      patches, whose first call ``torch.cuda.set_device(rank % device_count())`` (async_utils.py:565) divides
      by zero. ``PersistentAsyncCaller._get_process`` starts it with ``fork`` instead: it inherits them. The
      forked writer computes on one thread (``async_loop``): OpenMP's thread pool does not survive a fork, and
      the first parallel op of a writer forked after training started would wait on it forever.
    * ``async_utils`` (the writer's ``set_device``, the completion all-reduce), ``tensor_aware_state_dict``
      and ``exchange_utils`` (the local tier's ``synchronize`` and shard exchange) see :data:`CPU_TORCH`.
    * ``FileSystemWriterAsync.preload_tensors`` copies CPU tensors, for requests that the
      ``checkpointing.background_saves`` patch (which copies them itself) leaves as they are. On a GPU it is the
      device-to-host copy the trainer waits for; on the CPU ``.to('cpu')`` returns the training tensor itself,
      which the writer would then save while the next steps change it.
    """
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    original_start = PersistentAsyncCaller._get_process.__func__

    @functools.wraps(original_start)
    def _get_process(cls, rank, mp_mode="spawn", *args, **kwargs):
        return original_start(cls, rank, "fork", *args, **kwargs)

    original_loop = PersistentAsyncCaller.async_loop

    @functools.wraps(original_loop)
    def async_loop(*args, **kwargs):
        torch.set_num_threads(1)
        return original_loop(*args, **kwargs)

    original_preload = FileSystemWriterAsync.preload_tensors

    @functools.wraps(original_preload)
    def preload_tensors(write_buckets, non_blocking=True):
        copies = [(name, key, (bytes_data, [(item, tensor.detach().clone()) for item, tensor in tensors]))
                  for name, key, (bytes_data, tensors) in write_buckets]
        return original_preload(copies, non_blocking)

    replace_attr(PersistentAsyncCaller, "_get_process", classmethod(_get_process))
    replace_attr(PersistentAsyncCaller, "async_loop", staticmethod(async_loop))
    replace_attr(FileSystemWriterAsync, "preload_tensors", staticmethod(preload_tensors))
    _see_cpu_torch(
        "megatron.core.dist_checkpointing.strategies.async_utils",
        "megatron.core.dist_checkpointing.tensor_aware_state_dict",
        "megatron.core.dist_checkpointing.exchange_utils",
    )


@_cpu_patch("cpu.training_utils", "megatron.training.utils.common_utils.torch")
def patch_training_utils() -> None:
    """Give ``megatron.training.utils.common_utils`` the CPU view of torch.

    Covers the ``device='cuda'`` buffers of ``calc_params_l2_norm`` (l.55-60, 222-227),
    ``report_memory``'s ``torch.cuda.memory_*`` calls (l.322-327) and ``get_device_arch_version``
    (l.504), which ``validate_args`` reads when TP or CP > 1: it is 0, so those runs need
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` as on Hopper and MI300X.
    """
    _see_cpu_torch("megatron.training.utils.common_utils")


@_cpu_patch("cpu.core_utils", "megatron.core.utils.torch")
def patch_core_utils() -> None:
    """Give ``megatron.core.utils`` the CPU view of torch: the torch fallback of the apex/TE multi-tensor
    L2 norm used for the grad norm returns its result on ``device='cuda'`` (l.1332), and
    ``get_batch_on_this_tp_rank`` and the NVTX helpers call ``torch.cuda`` (l.2189-2300, 2729)."""
    _see_cpu_torch("megatron.core.utils")


@_cpu_patch("cpu.attention_masks", "megatron.core.transformer.utils.torch")
def patch_attention_masks() -> None:
    """Give ``megatron.core.transformer.utils`` the CPU view of torch: the default causal and sliding-window
    masks DotProductAttention builds when the batch carries no mask are ``device="cuda"`` (l.39, 44)."""
    _see_cpu_torch("megatron.core.transformer.utils")


@_cpu_patch("cpu.rope_utils", "megatron.core.models.common.embeddings.rope_utils.torch")
def patch_rope_utils() -> None:
    """Give ``megatron.core.models.common.embeddings.rope_utils`` the CPU view of torch: under context
    parallelism ``get_pos_emb_on_this_cp_rank`` indexes this rank's RoPE positions with a ``device="cuda"``
    tensor (l.62)."""
    _see_cpu_torch("megatron.core.models.common.embeddings.rope_utils")


@_cpu_patch("cpu.rotary_embedding", "megatron.core.models.common.embeddings.rotary_pos_embedding.torch")
def patch_rotary_embedding() -> None:
    """Let rotary embeddings find their device without ``torch.cuda``.

    ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()`` at every forward
    (rotary_pos_embedding.py:162): the only call a ZAYA1 forward makes of it, so that a model from
    ``load_pretrained`` runs once that process-wide patch is undone. The module sees :data:`CPU_TORCH`.
    """
    _see_cpu_torch("megatron.core.models.common.embeddings.rotary_pos_embedding")


@_cpu_patch("cpu.timers", "megatron.core.timers.torch")
def patch_timers() -> None:
    """Give ``megatron.core.timers`` the CPU view of torch: ``torch.cuda.synchronize`` in ``Timer.start``
    / ``stop`` (l.152, 165) is a no-op, and the all-gathered timings live on the CPU (l.303)."""
    _see_cpu_torch("megatron.core.timers")


@_cpu_patch("cpu.rerun_state_machine", "megatron.core.rerun_state_machine.torch")
def patch_rerun_state_machine() -> None:
    """Give ``megatron.core.rerun_state_machine`` the CPU view of torch: its ``device='cuda'`` flags
    (l.264-268) and its saved ``cuda_rng_state`` (l.979-992), the CPU generator state as in ``cpu.rng``."""
    _see_cpu_torch("megatron.core.rerun_state_machine")


@_cpu_patch("cpu.schedules", "megatron.core.pipeline_parallel.schedules.torch")
def patch_schedules() -> None:
    """Give ``megatron.core.pipeline_parallel.schedules`` the CPU view of torch: the token counters of the
    forward-backward schedules are ``torch.zeros([], device='cuda')`` (l.749, 1121, 2292)."""
    _see_cpu_torch("megatron.core.pipeline_parallel.schedules")


@_cpu_patch("cpu.ddp", "megatron.core.distributed.param_and_grad_buffer.torch")
def patch_ddp() -> None:
    """Give Megatron's DDP (``param_and_grad_buffer``, ``distributed_data_parallel``) the CPU view of torch:
    the communication stream and its waits (param_and_grad_buffer.py:632-814, distributed_data_parallel.py:297)
    become no-ops; CPU collectives are synchronous."""
    _see_cpu_torch(
        "megatron.core.distributed.param_and_grad_buffer",
        "megatron.core.distributed.distributed_data_parallel",
    )


@_cpu_patch("cpu.optimizer", "megatron.core.optimizer.optimizer.torch")
def patch_optimizer() -> None:
    """Give ``megatron.core.optimizer.optimizer`` the CPU view of torch: ``FP32Optimizer``'s ``_scale``
    (l.1249), the mixed-precision optimizers' ``found_inf`` / ``_scale_one`` (l.690-702) and the
    ``device='cuda'`` flag of l.315 live on the CPU."""
    _see_cpu_torch("megatron.core.optimizer.optimizer")


# --- 4. single call sites ------------------------------------------------------------------------


class _ReportCudaTensorTypes(torch.overrides.TorchFunctionMode):
    """While active, ``tensor.type()`` of a CPU tensor reports the CUDA type (``'torch.cuda.FloatTensor'``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and result.startswith("torch.") \
                and not result.startswith("torch.cuda."):
            return result.replace("torch.", "torch.cuda.", 1)
        return result


def _construct_reporting_cuda_types(cls) -> None:
    """Replace ``cls.__init__`` by itself run inside :class:`_ReportCudaTensorTypes`."""
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        with _ReportCudaTensorTypes():
            original(self, *args, **kwargs)

    replace_attr(cls, "__init__", __init__)


@_cpu_patch("cpu.clip_grads", "megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32")
def patch_clip_grads() -> None:
    """Let gradient clipping run on CPU gradients.

    ``clip_grad_by_total_norm_fp32`` asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``
    (clip_grads.py:174): it runs unchanged, inside a TorchFunctionMode that is active only for that call
    and only answers ``Tensor.type()`` with the CUDA type name (the narrowest hook for a type-string
    assert). The module also sees :data:`CPU_TORCH` for its ``device='cuda'`` norm buffers (l.96-231).
    Patched where it is imported: ``clip_grads`` and ``megatron.core.optimizer.optimizer``.
    """
    from megatron.core.optimizer import clip_grads, optimizer

    original = clip_grads.clip_grad_by_total_norm_fp32

    @functools.wraps(original)
    def clip_grad_by_total_norm_fp32(*args, **kwargs):
        with _ReportCudaTensorTypes():
            return original(*args, **kwargs)

    for module in (clip_grads, optimizer):
        replace_attr(module, "clip_grad_by_total_norm_fp32", clip_grad_by_total_norm_fp32)
    _see_cpu_torch("megatron.core.optimizer.clip_grads")


@_cpu_patch("cpu.distrib_optimizer", "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.__init__")
def patch_distrib_optimizer() -> None:
    """Let ``--use-distributed-optimizer`` build its parameter shards from CPU parameters.

    ``DistributedOptimizer.__init__`` sorts parameters by ``param.type()`` into fp16/bf16 (fp32 main copy)
    and fp32 (optimized in place) and raises ``TypeError`` for anything but a ``torch.cuda.*Tensor``
    (distrib_optimizer.py:401-483, 758). The constructor runs unchanged inside the same
    ``Tensor.type()``-only TorchFunctionMode as ``cpu.clip_grads``, active for that call only. The module
    also sees :data:`CPU_TORCH` for the ``.cuda()`` of its legacy DP-zero gather (l.1374).
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    _construct_reporting_cuda_types(DistributedOptimizer)
    _see_cpu_torch("megatron.core.optimizer.distrib_optimizer")


@_cpu_patch("cpu.float16_optimizer", "megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params.__init__")
def patch_float16_optimizer() -> None:
    """Let ``--bf16`` build Megatron's fp32 master weights of CPU parameters (``--optimizer zaya_muon``'s Muon half).

    ``Float16OptimizerWithFloat16Params.__init__`` sorts parameters by ``param.type()`` and raises ``TypeError`` for
    anything but a ``torch.cuda.*Tensor`` (optimizer.py:1033). The constructor runs unchanged inside the same
    ``Tensor.type()``-only TorchFunctionMode as ``cpu.distrib_optimizer``.
    """
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    _construct_reporting_cuda_types(Float16OptimizerWithFloat16Params)


def _gather_unequal_first_dim(input_, group, output_split_sizes):
    """All-gather rows of unequal counts with an equal-size all-gather: pad to the largest, then drop the pads."""
    longest = max(output_split_sizes)
    padded = input_.new_zeros((longest, *input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    gathered = torch.empty((longest * len(output_split_sizes), *input_.shape[1:]), dtype=input_.dtype)
    torch.distributed.all_gather_into_tensor(gathered, padded, group=group)
    return torch.cat([part[:size] for part, size in zip(gathered.chunk(len(output_split_sizes)), output_split_sizes)])


def _reduce_scatter_unequal_first_dim(input_, group, input_split_sizes):
    """Reduce-scatter rows of unequal counts with an equal-size reduce-scatter: pad each part to the largest."""
    longest = max(input_split_sizes)
    padded = input_.new_zeros((longest * len(input_split_sizes), *input_.shape[1:]))
    for part, rows in zip(padded.chunk(len(input_split_sizes)), torch.split(input_, input_split_sizes)):
        part[: rows.shape[0]] = rows
    output = input_.new_empty((longest, *input_.shape[1:]))
    torch.distributed.reduce_scatter_tensor(output, padded, group=group)
    return output[: input_split_sizes[group.rank()]]


@_cpu_patch("cpu.unequal_first_dim_collectives", "megatron.core.tensor_parallel.mappings._gather_along_first_dim")
def patch_unequal_first_dim_collectives() -> None:
    """Let the alltoall MoE dispatcher with expert tensor parallelism (ETP > 1) run on gloo.

    With ETP > 1, ``MoEAlltoAllTokenDispatcher`` all-gathers the tokens each expert-TP rank received and
    reduce-scatters the expert outputs back, with per-rank row counts (``output_split_sizes`` /
    ``input_split_sizes``, token_dispatcher.py). Megatron does that with the list forms of ``all_gather``
    and ``reduce_scatter`` (mappings.py:147-154, 188-197); gloo's ``allgather`` requires equal sizes and it
    has no list ``reduce_scatter``. The replacements pad every rank's rows to the largest count, run the
    equal-size collective (``all_gather_into_tensor`` / ``reduce_scatter_tensor``) and drop the padding, so
    the result is the same rows. Calls without split sizes go to the originals (patched in ``mappings``,
    whose autograd functions look the names up at call time).
    """
    from megatron.core.tensor_parallel import mappings

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    @functools.wraps(gather)
    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        return _gather_unequal_first_dim(input_, group, list(output_split_sizes))

    @functools.wraps(reduce_scatter)
    def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        return _reduce_scatter_unequal_first_dim(input_, group, list(input_split_sizes))

    replace_attr(mappings, "_gather_along_first_dim", _gather_along_first_dim)
    replace_attr(mappings, "_reduce_scatter_along_first_dim", _reduce_scatter_along_first_dim)


def _split_sizes_to_numpy(tensor, as_numpy=False, record_stream=False):
    """``maybe_move_tensor_to_cpu`` for CPU tensors: hand split sizes over as numpy, as after a D2H copy."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


@_cpu_patch("cpu.moe_alltoall", "megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu")
def patch_moe_alltoall() -> None:
    """Let the alltoall MoE dispatcher run on gloo.

    ``MoEAlltoAllTokenDispatcher`` copies its split sizes to the host with ``maybe_move_tensor_to_cpu(...,
    as_numpy=True)`` (token_dispatcher.py:927-944), which converts only CUDA tensors (moe_utils.py:1169);
    on CPU they stay tensors and gloo's ``all_to_all_single`` rejects tensor split sizes. The replacement
    converts CPU tensors to numpy as the CUDA path does (patched in ``moe_utils`` and in
    ``token_dispatcher``, which imports the name). ``token_dispatcher`` also sees :data:`CPU_TORCH` for
    its D2H side stream and event (l.469, 920-949).
    """
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    for module in (moe_utils, token_dispatcher):
        replace_attr(module, "maybe_move_tensor_to_cpu", _split_sizes_to_numpy)
    _see_cpu_torch("megatron.core.transformer.moe.token_dispatcher")


@_cpu_patch("cpu.p2p_communication", "megatron.core.pipeline_parallel.p2p_communication.torch")
def patch_p2p_communication() -> None:
    """Give ``megatron.core.pipeline_parallel.p2p_communication`` the CPU view of torch: after batched
    sends and receives it calls ``torch.cuda.synchronize()`` (l.264, 419), which raises without CUDA."""
    _see_cpu_torch("megatron.core.pipeline_parallel.p2p_communication")
