"""zaya-pretrain --use-distributed-optimizer resumes exactly (CPU, fp32, one rank).

Without Transformer Engine or apex, Megatron 0.19.2's distributed optimizer could not resume (``--load``
asserted, then refused to copy into fp32 parameter views), and with those worked around resumed silently
wrong (every parameter shared one Adam step counter, reset to the fresh optimizer's). The
``megatron_fixes.distopt_*`` patches fix it; here the real CLI proves it: the run resumed from the
step-2 checkpoint reproduces the uninterrupted run's losses of steps 3 and 4 bit for bit.
"""

from __future__ import annotations

from zaya_cli import QUICK, loss_csv, pretrain

from megatron_zaya.patches.cli import list_patches


def test_distributed_optimizer_resume_is_exact(tmp_path):
    common = QUICK + ["--train-iters", "4", "--use-distributed-optimizer"]
    full = tmp_path / "full"
    run = pretrain(common + ["--save", str(full), "--load", str(full), "--save-interval", "2"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]

    resumed_plot = tmp_path / "resumed" / "loss.png"
    no_checkpoint = ["--save", ""]
    resumed = pretrain(common + ["--load", str(full), "--ckpt-step", "2", "--zaya-loss-plot", str(resumed_plot),
                                 *no_checkpoint], cwd=tmp_path)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    row = next(line for line in list_patches().splitlines() if line.startswith("megatron_fixes.distopt_step_per_param"))
    assert "no:" not in row, row  # the patch applies here

    uninterrupted, after = loss_csv(full / "loss.csv"), loss_csv(resumed_plot.with_suffix(".csv"))
    assert sorted(after) == [3, 4]
    assert all(after[i] == uninterrupted[i] for i in after), (after, uninterrupted)
