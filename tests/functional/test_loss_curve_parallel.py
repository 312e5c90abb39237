"""The loss curve of a data-parallel run is the whole batch's loss, not the writing rank's share of it; and DP2
with zaya_muon's ZeRO-1 sharding under Megatron's overlap flags trains as one process does."""

from __future__ import annotations

from zaya_cli import MUON_RUN, loss_csv, pretrain

DISTRIBUTED = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]


def test_dp2_loss_curve_equals_one_process(muon_run, tmp_path):
    two = pretrain(MUON_RUN + DISTRIBUTED + ["--exit-interval", "3", "--save", str(tmp_path / "two")], cwd=tmp_path,
                   nproc=2)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    expected, got = loss_csv(muon_run / "full" / "loss.csv"), loss_csv(tmp_path / "two" / "loss.csv")
    assert sorted(got) == [1, 2, 3]
    for iteration in got:
        assert abs(got[iteration] - expected[iteration]) <= 1e-5 * expected[iteration], (iteration, got, expected)
