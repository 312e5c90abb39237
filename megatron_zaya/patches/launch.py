"""Patch group ``launch``: torchrun's elastic agent, in the launcher's own process (``zaya-torchrun``)."""

from __future__ import annotations

import functools
import sys

from .registry import register, replace_attr


@register("launch.clean_stop_exits_0", target="torch.distributed.elastic.agent.server.api.SimpleElasticAgent.run")
def clean_stop_exits_0():
    """The launcher, stopped by a signal, exits 0 when every worker it passed the signal to exited 0.

    On SIGTERM or SIGINT (a pre-emption, ``scancel``, Ctrl-C) torch's elastic agent sends the signal to its
    workers, waits for them (``--shutdown-timeout``) and raises the signal's exception again, so torchrun exits
    1 even when every rank saved its checkpoint and exited 0: a scheduler or a requeue script counts a clean
    pre-emption as a failure. Patched, ``run`` returns success in that case; a worker that exited non-zero, was
    killed, or whose exit code torch does not keep (function entry points) leaves the exception and exit 1.
    ``zaya-torchrun`` applies it, and no other patch, in the launcher's process (in a trainer, where no agent
    runs, it changes nothing). Off: launch with plain ``torchrun``, or leave ``launch`` out of ``ZAYA_PATCHES``.
    """
    from torch.distributed.elastic.agent.server.api import RunResult, SimpleElasticAgent, WorkerState
    from torch.distributed.elastic.multiprocessing import SignalException

    run = SimpleElasticAgent.run

    @functools.wraps(run)
    def run_clean_stop_exits_0(self, *args, **kwargs):
        try:
            return run(self, *args, **kwargs)
        except SignalException as stop:
            handlers = getattr(getattr(self, "_pcontext", None), "subprocess_handlers", None) or {}
            codes = [handler.proc.returncode for handler in handlers.values()]
            if not codes or any(code != 0 for code in codes):
                raise
            print(f"zaya-torchrun: stopped by {stop.sigval.name}; all {len(codes)} workers exited 0 after it: "
                  "exit 0", file=sys.stderr, flush=True)
            return RunResult(state=WorkerState.SUCCEEDED)

    replace_attr(SimpleElasticAgent, "run", run_clean_stop_exits_0)


@register("launch.no_restart_after_a_stop",
          target="torch.distributed.elastic.agent.server.local_elastic_agent.LocalElasticAgent._monitor_workers")
def no_restart_after_a_stop():
    """The launcher does not restart a group in which a worker stopped on purpose: bad input (exit 2), a crash loop
    (exit 5) or a node that failed its self-test (exit 6).

    torch's elastic agent restarts the group on any worker failure until ``--max-restarts`` is spent. Bad input is
    refused again at each restart, a run stopped by ``--zaya-max-step-failures`` would stop again, and a node that
    failed its self-test fails it again: the restarts only cost start-ups, and hide the code from the scheduler.
    Patched, the agent's ``_monitor_workers`` leaves no restarts when a failed worker exited with one of these codes,
    so the agent stops the group, and ``zaya-torchrun`` exits with that code (``megatron_zaya/launch.py``) for the
    Slurm scripts to tell bad input and a crash loop (no requeue) from a bad node (requeue without it).
    ``zaya-torchrun`` applies it in its own process. Off: launch with plain ``torchrun``, or leave ``launch`` out of
    ``ZAYA_PATCHES``.
    """
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from megatron_zaya.launch import STOP_CODES

    monitor = LocalElasticAgent._monitor_workers

    @functools.wraps(monitor)
    def monitor_workers(self, worker_group):
        result = monitor(self, worker_group)
        if result.state == WorkerState.FAILED and any(f.exitcode in STOP_CODES for f in result.failures.values()):
            self._remaining_restarts = 0
        return result

    replace_attr(LocalElasticAgent, "_monitor_workers", monitor_workers)


@register("launch.store_per_restart", target="torch.distributed.rendezvous._create_c10d_store")
def store_per_restart():
    """Each restart of a torchrun group keys its process group's rendezvous apart from the launches before it.

    Under torchrun the workers' ``init_process_group`` (``env://``) connects to the elastic agent's TCP store
    (``TORCHELASTIC_USE_AGENT_STORE``), which outlives a restart with every key the failed launch wrote: a restarted
    rank then reads a peer's address or communicator id of the launch before (gloo: "connectFullMesh failed ...
    Connection refused") instead of waiting for the new one. Patched, ``_create_c10d_store`` hands the workers of
    restart N a ``PrefixStore("restart_N/", store)``; the first launch keeps the bare store. It applies in the
    trainers (zaya-pretrain), where the process group is created. Off: leave ``launch`` out of ``--zaya-patches`` /
    ``ZAYA_PATCHES``.
    """
    import importlib
    import os

    from torch.distributed import PrefixStore

    rendezvous = importlib.import_module("torch.distributed.rendezvous")  # the package's name is a function
    create = rendezvous._create_c10d_store

    @functools.wraps(create)
    def create_c10d_store(*args, **kwargs):
        store = create(*args, **kwargs)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return store if restart == "0" else PrefixStore(f"restart_{restart}/", store)

    replace_attr(rendezvous, "_create_c10d_store", create_c10d_store)
