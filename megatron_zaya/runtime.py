"""Process set-up: a single process outside a training launcher (conversion, inference, tests), the master port
of a single-node run, and a quiet start (warnings about optional packages in one line, the start-up record
kept for the run directory, the first rank's notes once each)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import signal
import socket
import sys
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist


def ensure_single_process_parallel_state() -> None:
    """Initialise torch.distributed (world size 1) and Megatron's parallel state (all sizes 1) if needed.

    Also applies the patch hooks selected by ``ZAYA_PATCHES`` (on a CPU-only machine that includes the
    ``cpu`` group, which Megatron's model code needs).
    """
    from megatron.core import parallel_state

    from megatron_zaya.patches import apply_patches

    apply_patches()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        # An in-memory store: no port, and no MASTER_ADDR/PORT left in os.environ for child processes (a
        # zaya-pretrain started from this process would inherit the port and fail to bind it).
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel hands out for outgoing connections (Linux's default if it does not say)."""
    try:
        low, high = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_master_port(host: str = "127.0.0.1", start: int | None = None) -> int:
    """A port for a single-node rendezvous: below the ephemeral range (where any outgoing connection may take
    a port between this check and the bind), free when tried, from ``start`` (default: by process id) on."""
    low = max(ephemeral_port_range()[0], 20001)
    candidates = range(20000, low)
    first = (start if start is not None else 20000 + os.getpid() % len(candidates)) - 20000
    for offset in range(len(candidates)):
        port = candidates[(first + offset) % len(candidates)]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free TCP port in {candidates.start}-{candidates.stop - 1} on {host}; set MASTER_PORT")


_PR_SET_PDEATHSIG = 1


def end_helpers_with_this_process() -> None:
    """Let every process this one forks from its main thread (data-loader workers, checkpoint writers, the
    multiprocessing fork server) die with it, also when it is SIGKILLed: the child asks the kernel for a
    SIGKILL when its parent ends (``PR_SET_PDEATHSIG``, Linux; kept across ``exec``). Children forked from
    other threads are left alone: the kernel sends that signal when the forking *thread* ends."""
    if not sys.platform.startswith("linux"):
        return
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = {}

    def before_fork():
        parent["main thread"] = threading.current_thread() is threading.main_thread()
        parent["pid"] = os.getpid()

    def in_child():
        if parent.get("main thread"):
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent["pid"]:  # the parent ended before the request
                os.kill(os.getpid(), signal.SIGKILL)

    os.register_at_fork(before=before_fork, after_in_child=in_child)


def end_data_workers_at_exit() -> None:
    """Shut down data-loader workers still running at exit, the way an iterator that runs out does.

    With ``--exit-signal-handler`` Megatron's ``worker_init_fn`` gives every data-loader worker a SIGTERM handler
    that only sets a flag (so that a job-wide SIGTERM leaves them serving the step before the save). A run that
    ends on an exception (a failed save, a fault, a traceback) keeps its iterators alive in the exception's
    reference cycles until after the exit handlers; torch's own shutdown of their workers does nothing once the
    interpreter is exiting, and multiprocessing's exit handler then SIGTERMs them (ignored) and joins them:
    forever. Registered after torch's and multiprocessing's exit handlers, this one runs before them."""
    import atexit
    import gc

    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    def shut_down():
        gc.unfreeze()  # set-up's objects, frozen by training_loop.frozen_setup_objects, are hidden from get_objects
        for live in gc.get_objects():
            if type(live) is _MultiProcessingDataLoaderIter:  # (isinstance would ask dead weak proxies too)
                live._shutdown_workers()

    atexit.register(shut_down)


# Megatron's argument dump and the patch lines of this process, for the run directory's START_LOG_NAME.
START_LOG: list[str] = []
START_LOG_NAME = "zaya-start.log"
_OPTIONAL = {"Transformer Engine": "transformer engine", "Apex": "apex", "absl-py": "absl"}


def is_rank_0() -> bool:
    """Global rank 0 of a launch (the launcher's ``RANK``), or a process started without one."""
    return os.environ.get("RANK", "0") == "0"


def relaunch_count() -> int:
    """How many times the launcher has started this job again: torchrun's restarts plus Slurm's requeues."""
    return sum(int(os.environ.get(name) or 0) for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))


def print_rank_0(message: str, file=None) -> None:
    """``print`` on global rank 0 only (every process when torch.distributed is not initialised), flushed."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, file=file or sys.stdout, flush=True)


def on_any_rank(flag: bool, group=None) -> bool:
    """Whether ``flag`` holds on any rank of ``group`` (every rank when None): one all-reduce, which each rank of the
    group must make; ``flag`` itself when torch.distributed is not initialised."""
    if not dist.is_initialized():
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    held = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(held, op=dist.ReduceOp.MAX, group=group)
    return bool(held.item())


@functools.cache
def say_once(message: str) -> None:
    """``message`` logged as a warning once per process, by the first rank only: a note that every layer would
    repeat (a fused op that a layout does not take, say)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        logging.getLogger(__name__).warning(message)


# Warnings that Megatron (or torch, about Megatron's calls) raises in every run and that nobody running
# zaya-pretrain can act on: (the start of the message, why it is noise).
KNOWN_NOISE = (
    ("Could not determine rank from torch.distributed", "Megatron asks for its rank before it starts"),
    ("\\s*It is recommended to use a ModelConfig", "ZAYA1 is built by a model provider, a hook Megatron documents"),
    ("MimoModelConfig is experimental", "importing Megatron imports its multimodal package; ZAYA1 does not use it"),
    ("'pin_memory' argument is set as true but no accelerator", "a CPU run: Megatron's data loader pins memory"),
    ("`torch.distributed.all_gather_into_tensor` is deprecated", "newer torch; Megatron's and our gradient "
     "buffers use it, and its successor is missing from the torch versions we support"),
)


def ignore_known_noise() -> None:
    """Ignore the warnings of :data:`KNOWN_NOISE` from here on (in the current warnings context)."""
    for message, _why in KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=message)


@contextlib.contextmanager
def one_line_for_missing_packages():
    """Importing Megatron without Transformer Engine, Apex or absl-py raises a dozen warnings (and torch logs
    that there is no CUDA runtime): within this block they become one ``[zaya]`` line on rank 0; every other
    warning is shown as usual, at the end of the block, but for :data:`KNOWN_NOISE`, which is ignored within
    and after it."""
    cpp_extension = logging.getLogger("torch.utils.cpp_extension")
    level = cpp_extension.level
    cpp_extension.setLevel(logging.ERROR)
    ignore_known_noise()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            ignore_known_noise()
            yield
    finally:
        cpp_extension.setLevel(level)
    missing = []
    for warning in caught:
        text = str(warning.message).lower().replace("-", " ").replace("_", " ")
        names = [name for name, key in _OPTIONAL.items() if key in text]
        if names and ("not installed" in text or "version" in text):
            missing += [name for name in names if name not in missing]
        else:
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    if missing and is_rank_0():
        print(f"[zaya] not installed: {', '.join(missing)}; Megatron uses its torch fallbacks (the same results; "
              "on GPU its fused norms and optimizer steps are slower)", flush=True)


def write_start_log(run_dir: str | None, applied: int, patches: int) -> None:
    """On rank 0, append :data:`START_LOG` to ``run_dir``'s :data:`START_LOG_NAME` (one section per launch)
    and print the one console line that names it. From then on, on every rank, Megatron's set-up detail
    (:data:`SET_UP_DETAIL_LOGGERS`) goes to that file too, not to the console."""
    path = Path(run_dir) / START_LOG_NAME if run_dir and is_rank_0() else None
    root = logging.getLogger()  # its handler: Megatron's console handler, installed when Megatron is imported
    root.handlers = [_SetUpDetailToFile(handler, path) for handler in root.handlers]
    if not is_rank_0():
        return
    summary = f"{applied} of {patches} patches applied"
    if path is None:
        print(f"[zaya] {summary}; the argument dump and patch lines are not kept (no --save directory)", flush=True)
        return
    with path.open("a") as stream:
        stream.write(f"==================== launch at {time.strftime('%Y-%m-%d %H:%M:%S')}, pid {os.getpid()}\n")
        stream.write("\n".join(START_LOG) + "\n")
    print(f"[zaya] {summary}; the argument dump and patch lines: {path}", flush=True)


# Megatron's loggers whose INFO records are set-up detail: the DDP config and every parameter of every gradient
# bucket (about 60 lines per ZAYA1 layer), the optimizer config, the datasets' configs and index builds.
SET_UP_DETAIL_LOGGERS = ("megatron.core.distributed", "megatron.core.optimizer", "megatron.core.datasets")


class _SetUpDetailToFile(logging.Handler):
    """Stands in front of a console handler (Megatron's, whose own ``filter`` takes no added filters): the INFO
    records of :data:`SET_UP_DETAIL_LOGGERS` are appended to ``path`` (None: dropped); the rest go on to it."""

    def __init__(self, console: logging.Handler, path: Path | None):
        super().__init__(console.level)
        self.console, self.path = console, path

    def handle(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING or not record.name.startswith(SET_UP_DETAIL_LOGGERS):
            return self.console.handle(record)
        if self.path is not None:
            with self.path.open("a") as stream:
                stream.write(f"{record.levelname}:{record.name}:{record.getMessage()}\n")
        return True
