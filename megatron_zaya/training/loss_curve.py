"""The training-loss curve: recorded by the loss function, pooled over data- and context-parallel ranks at each
checkpoint save and at the end, written as CSV (at each save, before it: a run that crashes keeps the curve of
the steps its checkpoint holds) and, at the end, as PNG. A resumed run adds to the curve of the runs before it: their
points up to the iteration it resumed from are kept, later ones (steps it repeats) replaced."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch


class LossCurve:
    """Per-iteration token-weighted mean of the training loss (micro-batches of a step pooled; after
    :meth:`pool`, the ranks of the group too)."""

    def __init__(self):
        self.path: Path | None = None  # the PNG; the CSV beside it. None: no curve is recorded
        # Device tensors, read back only when the curve is pooled: no host sync per micro-batch.
        self._sums: dict[int, list] = defaultdict(lambda: [0.0, 0.0])
        self._pooled: dict[int, tuple[float, float]] = {}  # the iterations pooled so far: (loss sum, tokens)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def add(self, loss_sum: torch.Tensor, num_tokens: torch.Tensor) -> None:
        if not self.enabled or not torch.is_grad_enabled():  # evaluation runs under no_grad
            return
        from megatron.training import get_args

        entry = self._sums[get_args().curr_iteration + 1]
        entry[0] = entry[0] + loss_sum.detach().double()
        entry[1] = entry[1] + num_tokens.detach().double()

    def pool(self, group) -> None:
        """Sum every rank's per-iteration loss and token counts recorded since the last pool over ``group`` (every
        rank of it must call), read back from the device in one copy."""
        import torch.distributed as dist

        iterations = sorted(self._sums)
        if not iterations:
            return
        totals = torch.stack([torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in self._sums[i]])
                              for i in iterations])
        if group is not None and dist.get_world_size(group) > 1:
            totals = totals.to("cuda" if torch.cuda.is_available() else "cpu")
            dist.all_reduce(totals, group=group)
        pooled = totals.cpu().tolist()
        self._pooled.update({i: (total[0], total[1]) for i, total in zip(iterations, pooled, strict=True)})
        self._sums.clear()

    def points(self) -> list[tuple[int, float]]:
        """The pooled iterations' token-weighted mean losses."""
        return [(it, s / max(n, 1.0)) for it, (s, n) in sorted(self._pooled.items())]

    def pool_for_save(self) -> None:
        """Before a checkpoint save, on every rank: pool the steps since the last pool, so that its read-back from
        the device does not queue behind the copies to host memory that the save starts."""
        if self.enabled:
            self.pool(curve_group())

    def save_csv(self) -> None:
        """At a checkpoint save: the rank that writes the curve writes its CSV."""
        if self.enabled and writes_curve():
            self.write_csv()

    def write_csv(self) -> list[tuple[int, float]]:
        """The pooled points, after the points of the runs before this one, to the CSV beside :attr:`path`;
        returns what it wrote."""
        points = self.points()
        csv = self.path.with_suffix(".csv")
        csv.parent.mkdir(parents=True, exist_ok=True)
        first = points[0][0] if points else 0
        points = [p for p in _read_csv(csv) if p[0] < first] + points
        staging = csv.with_name(f".{csv.name}.tmp")
        staging.write_text("iteration,loss\n" + "".join(f"{i},{v!r}\n" for i, v in points))
        staging.replace(csv)
        return points

    def write(self) -> Path:
        """The CSV and the PNG at :attr:`path` (its plot of the CSV's points); returns the PNG path.

        Drawn on a bare Agg figure, not through pyplot, whose backend choice is global to the process (a notebook
        or application that imports this keeps its own)."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        png = self.path
        points = self.write_csv()
        fig = Figure(figsize=(6, 3.5), dpi=120)
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        ax.plot([p[0] for p in points], [p[1] for p in points], lw=1.2)
        ax.set_xlabel("iteration")
        ax.set_ylabel("training loss (nats/token)")
        ax.set_title("ZAYA1 training loss")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(png)
        return png


def curve_group():
    """The ranks whose losses make up one step's: the data- and context-parallel group."""
    from megatron.core import parallel_state as mpu

    return mpu.get_data_parallel_group(with_context_parallel=True)


def writes_curve() -> bool:
    """Whether this rank writes the curve: the last pipeline stage's first data-, context- and tensor-parallel
    rank (it computed losses)."""
    from megatron.core import parallel_state as mpu

    return (mpu.is_pipeline_last_stage() and mpu.get_data_parallel_rank() == 0
            and mpu.get_context_parallel_rank() == 0 and mpu.get_tensor_model_parallel_rank() == 0)


def _read_csv(path: Path) -> list[tuple[int, float]]:
    """The points of an earlier run's curve (none if there is none or it is unreadable)."""
    points = []
    try:
        lines = path.read_text().splitlines()[1:]
    except OSError:
        return points
    for line in lines:
        try:
            iteration, loss = line.split(",")
            points.append((int(iteration), float(loss)))
        except ValueError:
            continue  # a line cut short by a kill while it was written by an older version
    return points


LOSS_CURVE = LossCurve()
