"""TESTING HOOK: deliberate faults for the reliability tests (``docs/reliability.md``). Never set it in a real run.

``ZAYA_FAULT_INJECT="kind@iteration[@rank],..."`` makes the trainer poison or break the given (1-based)
iteration, on every rank or only on ``rank`` (global rank). Kinds:

* ``nan_loss`` / ``inf_loss``: the micro-batch losses of that iteration become NaN / +Inf (and so do their grads);
* ``nan_grad`` / ``inf_grad``: one gradient element becomes NaN / +Inf after the gradient all-reduce;
* ``loss_spike``: the losses of that iteration are multiplied by 10;
* ``drift``: one weight of this rank changes by +1 (data-parallel replicas disagree from then on).

This module is the only place that reads the variable; with it unset every query is False.
"""

from __future__ import annotations

import functools
import os

ENV_VAR = "ZAYA_FAULT_INJECT"
KINDS = ("nan_loss", "inf_loss", "nan_grad", "inf_grad", "loss_spike", "drift")


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

