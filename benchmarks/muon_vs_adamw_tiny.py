"""Muon vs AdamW on the embedded corpus: the tiny preset, the main job's schedule, equal steps (CPU is enough).

    python -m benchmarks.muon_vs_adamw_tiny [OUT_DIR]      # writes OUT_DIR/muon-vs-adamw-tiny.png and .csv

Both runs use the main job's flags (300 steps, lr 3e-3 with warmup and cosine decay, weight decay 0.1); Muon's
update is RMS-matched to AdamW (0.2·sqrt(max(rows, cols))), so the same lr is each one's default.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    curves = {}
    for optimizer in ("adam", "zaya_muon"):
        run_dir = out / optimizer
        subprocess.run([sys.executable, "-m", "megatron_zaya.pretrain", "--optimizer", optimizer,
                        "--save", str(run_dir), "--load", str(run_dir), "--eval-iters", "0"], check=True)
        rows = (run_dir / "loss.csv").read_text().splitlines()[1:]
        curves[optimizer] = [(int(i), float(v)) for i, v in (row.split(",") for row in rows)]

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    for optimizer, points in curves.items():
        label = "AdamW" if optimizer == "adam" else "Muon"
        ax.plot([p[0] for p in points], [p[1] for p in points], lw=1.0, label=label)
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title("ZAYA1 tiny on the embedded corpus")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "muon-vs-adamw-tiny.png")
    with open(out / "muon-vs-adamw-tiny.csv", "w") as f:
        f.write("iteration,adamw,muon\n")
        for (i, a), (_, m) in zip(curves["adam"], curves["zaya_muon"]):
            f.write(f"{i},{a},{m}\n")
    last = {k: sum(v for _, v in pts[-20:]) / 20 for k, pts in curves.items()}
    print(f"mean training loss over the last 20 steps: AdamW {last['adam']:.4f}, Muon {last['zaya_muon']:.4f}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/muon-vs-adamw"))
