"""The loss curve of a data-parallel run is the whole batch's loss, not the writing rank's share of it; and DP2
trains as one process does, also with zaya_muon's own sharding under Megatron's overlap flags."""

from __future__ import annotations

import pytest
from zaya_cli import QUICK, pretrain

DISTRIBUTED = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]


def _loss_csv(path):
    rows = path.read_text().splitlines()[1:]
    return {int(i): float(v) for i, v in (row.split(",") for row in rows)}


@pytest.mark.parametrize("optimizer, dp2_flags", [("adam", []), ("zaya_muon", DISTRIBUTED)],
                         ids=["adam", "zaya_muon_distributed_overlapped"])
def test_dp2_loss_curve_equals_one_process(tmp_path, optimizer, dp2_flags):
    flags = QUICK + ["--train-iters", "3", "--save-interval", "1000", "--optimizer", optimizer]
    one = pretrain(flags + ["--save", str(tmp_path / "one")], cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    two = pretrain(flags + dp2_flags + ["--save", str(tmp_path / "two")], cwd=tmp_path, nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    expected, got = _loss_csv(tmp_path / "one" / "loss.csv"), _loss_csv(tmp_path / "two" / "loss.csv")
    assert sorted(got) == sorted(expected) == [1, 2, 3]
    for iteration, loss in expected.items():
        assert abs(got[iteration] - loss) <= 1e-5 * loss, (iteration, got[iteration], loss)
