"""The training-loss curve: recorded by the loss function, pooled over data- and context-parallel ranks once at
the end, written as CSV and PNG. A resumed run adds to the curve of the runs before it: their points up to
the iteration it resumed from are kept, later ones (steps it repeats) replaced."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch


class LossCurve:
    """Per-iteration token-weighted mean of the training loss (micro-batches of a step pooled; after
    :meth:`pool`, the ranks of the group too)."""

    def __init__(self):
        self.enabled = False
        # Device tensors, read back only when the curve is written: no host sync per micro-batch.
        self._sums: dict[int, list] = defaultdict(lambda: [0.0, 0.0])

    def add(self, loss_sum: torch.Tensor, num_tokens: torch.Tensor) -> None:
        if not self.enabled or not torch.is_grad_enabled():  # evaluation runs under no_grad
            return
        from megatron.training import get_args

        entry = self._sums[get_args().curr_iteration + 1]
        entry[0] = entry[0] + loss_sum.detach().double()
        entry[1] = entry[1] + num_tokens.detach().double()

    def pool(self, group) -> None:
        """Sum every rank's per-iteration loss and token counts over ``group`` (every rank of it must call)."""
        import torch.distributed as dist

        if not self._sums or group is None or dist.get_world_size(group) == 1:
            return
        iterations = sorted(self._sums)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        totals = torch.tensor([[float(s), float(n)] for s, n in (self._sums[i] for i in iterations)],
                              dtype=torch.float64, device=device)
        dist.all_reduce(totals, group=group)
        self._sums.update({i: [total[0], total[1]] for i, total in zip(iterations, totals.cpu(), strict=True)})

    def points(self) -> list[tuple[int, float]]:
        return [(it, float(s) / max(float(n), 1.0)) for it, (s, n) in sorted(self._sums.items())]

    def write(self, png_path: str | Path) -> Path:
        """Write ``png_path`` and a ``.csv`` beside it; returns the PNG path."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        png = Path(png_path)
        png.parent.mkdir(parents=True, exist_ok=True)
        points = self.points()
        csv = png.with_suffix(".csv")
        first = points[0][0] if points else 0
        points = [p for p in _read_csv(csv) if p[0] < first] + points
        staging = csv.with_name(f".{csv.name}.tmp")
        staging.write_text("iteration,loss\n" + "".join(f"{i},{v!r}\n" for i, v in points))
        staging.replace(csv)
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
        ax.plot([p[0] for p in points], [p[1] for p in points], lw=1.2)
        ax.set_xlabel("iteration")
        ax.set_ylabel("training loss (nats/token)")
        ax.set_title("ZAYA1 training loss")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(png)
        plt.close(fig)
        return png


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
