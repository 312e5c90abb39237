"""Start-up time of the command-line tools: ``zaya-convert --help``, ``zaya-preprocess --help``, and a
two-step ``zaya-pretrain`` run that saves a checkpoint (the tiny preset on the embedded corpus, CPU or GPU),
with Adam and with Muon, with the time at which each stage of its start, its steps, its save and its exit is
reached.

With ``--baseline DIR`` (a copy of another version's ``megatron_zaya`` package, e.g. from
``git archive REV megatron_zaya | tar -x -C DIR``) the same commands run against it too, alternating with this
tree's, and the table gives this tree's time as a ratio of the baseline's (median of ``--repeats``).

    python -m benchmarks.start_time --baseline /tmp/base --repeats 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

# The stages of zaya-pretrain's start, by the first line of its output that shows each was reached.
STAGES = {
    "arguments parsed and checked": "patches applied",
    "Megatron initialised": "time to initialize megatron",
    "model and optimizer built": "[after model, optimizer, and learning rate scheduler are built]",
    "data loaders built": "[after dataloaders are built]",
    "first iteration": " iteration        1/",
    "second iteration": " iteration        2/",
    "checkpoint saved": "successfully saved checkpoint",
}
# The runs timed, by their optimizer flags: Adam (the main job's) and Muon (whose step is the second iteration's
# difference between them).
OPTIMIZERS = {"zaya-pretrain": [], "zaya-pretrain --optimizer zaya_muon": ["--optimizer", "zaya_muon"]}
PRETRAIN_FLAGS = ["--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "2",
                  "--eval-iters", "0", "--log-interval", "1", "--lr-warmup-iters", "1"]
TOOLS = {
    "zaya-convert --help": "import sys; from megatron_zaya.convert.cli import main; sys.exit(main(['--help']))",
    "zaya-preprocess --help": "from megatron_zaya.data.preprocess import main; main(['--help'])",
}


def _env(tree: Path) -> dict[str, str]:
    """``tree``'s megatron_zaya first on the path (the commands run outside it: ``python -c`` puts the working
    directory first, and so does ``-m``)."""
    return {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}


def tool_seconds(tree: Path, code: str, cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], cwd=cwd, env=_env(tree), capture_output=True, check=True)
    return time.perf_counter() - start


def pretrain_stages(tree: Path, cwd: Path, flags: list[str]) -> dict[str, float]:
    """Seconds from launch to each stage of STAGES, and to the exit of the command as users run it (a fresh
    run: no checkpoint to resume)."""
    ckpt = cwd / "ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    start = time.perf_counter()
    command = [sys.executable, "-m", "megatron_zaya.pretrain", *PRETRAIN_FLAGS, *flags, "--save", str(ckpt)]
    proc = subprocess.Popen(command, cwd=cwd, env=_env(tree), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    reached = {}
    for line in proc.stdout:
        for stage, marker in STAGES.items():
            if stage not in reached and marker in line:
                reached[stage] = time.perf_counter() - start
    code = proc.wait()
    reached["exited"] = time.perf_counter() - start
    if code:
        raise SystemExit(f"zaya-pretrain from {tree} exited with {code}")
    missing = [stage for stage in STAGES if stage not in reached]
    if missing:
        raise SystemExit(f"zaya-pretrain from {tree} ended before: {', '.join(missing)}")
    return reached


def measure(trees: dict[str, Path], repeats: int) -> dict[str, dict[str, list[float]]]:
    """``{tree name: {what: [seconds per repeat]}}``; the trees alternate within each repeat."""
    results = {name: {} for name in trees}
    with tempfile.TemporaryDirectory() as scratch:
        for name, tree in trees.items():  # untimed: builds the embedded dataset's cache, warms the file cache
            pretrain_stages(tree, Path(scratch), [])
        for _ in range(repeats):
            for name, tree in trees.items():
                for tool, code in TOOLS.items():
                    results[name].setdefault(tool, []).append(tool_seconds(tree, code, Path(scratch)))
                for run, flags in OPTIMIZERS.items():
                    for stage, seconds in pretrain_stages(tree, Path(scratch), flags).items():
                        results[name].setdefault(f"{run}: {stage}", []).append(seconds)
    return results


def table(results: dict[str, dict[str, list[float]]]) -> str:
    names = list(results)
    header = "| | " + " | ".join(f"{n}, s" for n in names) + (" | this / baseline |" if len(names) > 1 else " |")
    lines = [header, "| --- |" + " ---: |" * (len(names) + (len(names) > 1))]
    for what in results[names[0]]:
        medians = [statistics.median(results[n][what]) for n in names]
        cells = [f"{m:.2f}" for m in medians] + ([f"{medians[0] / medians[1]:.2f}"] if len(names) > 1 else [])
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="directory holding another version's megatron_zaya package")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    trees = {"this tree": HERE}
    if args.baseline:
        trees["baseline"] = args.baseline.resolve()
    print(table(measure(trees, args.repeats)))


if __name__ == "__main__":
    main()
