"""TESTING HOOK: a SIGKILL during a save, for the reliability tests (``docs/reliability.md``). Never set it in a
real run.

``ZAYA_FAULT_INJECT="kind@iteration[@rank],..."``: ``kill_in_save`` SIGKILLs the trainer while the checkpoint
of that (1-based) iteration is being committed (data written, the ``latest`` marker not yet replaced), on every
rank or only on ``rank`` (global rank). The other kinds (NaN/Inf losses and gradients, loss spikes, replica
drift) are injected from outside the trainer by ``tests/fault_hooks/sitecustomize.py``; they are accepted here
so that one variable can name both.
"""

from __future__ import annotations

import functools
import os
import signal

ENV_VAR = "ZAYA_FAULT_INJECT"
KINDS = ("nan_loss", "inf_loss", "nan_grad", "inf_grad", "loss_spike", "drift", "kill_in_save")


@functools.cache
def _plan(spec: str) -> tuple[tuple[str, int, int | None], ...]:
    faults = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        kind, _, rest = item.partition("@")
        iteration, _, rank = rest.partition("@")
        if kind not in KINDS or not iteration.isdigit() or (rank and not rank.isdigit()):
            raise ValueError(f"{ENV_VAR}: bad entry {item!r}; use kind@iteration[@rank], kind one of "
                             f"{', '.join(KINDS)}")
        faults.append((kind, int(iteration), int(rank) if rank else None))
    return tuple(faults)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def fault(kind: str, iteration: int) -> bool:
    """Whether the testing hook asks for ``kind`` at ``iteration`` on this rank."""
    spec = os.environ.get(ENV_VAR)
    if not spec:
        return False
    return any(k == kind and i == iteration and r in (None, _rank()) for k, i, r in _plan(spec))


def kill_if_asked(kind: str, iteration: int) -> None:
    if fault(kind, iteration):
        print(f"[zaya] {ENV_VAR}: SIGKILL at {kind}@{iteration}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
