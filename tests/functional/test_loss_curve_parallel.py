"""The loss curve of a data-parallel run is the whole batch's loss, not the writing rank's share of it; and DP2
with zaya_muon's ZeRO-1 sharding under Megatron's overlap flags, and TP2, train as one process does."""

from __future__ import annotations

from zaya_cli import QUICK, pretrain

DISTRIBUTED = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]


def _loss_csv(path):
    rows = path.read_text().splitlines()[1:]
    return {int(i): float(v) for i, v in (row.split(",") for row in rows)}


def test_dp2_loss_curve_equals_one_process(tmp_path):
    flags = QUICK + ["--train-iters", "3", "--save-interval", "1000", "--optimizer", "zaya_muon"]
    one = pretrain(flags + ["--save", str(tmp_path / "one")], cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    two = pretrain(flags + DISTRIBUTED + ["--save", str(tmp_path / "two")], cwd=tmp_path, nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    expected, got = _loss_csv(tmp_path / "one" / "loss.csv"), _loss_csv(tmp_path / "two" / "loss.csv")
    assert sorted(got) == sorted(expected) == [1, 2, 3]
    for iteration, loss in expected.items():
        assert abs(got[iteration] - loss) <= 1e-5 * loss, (iteration, got[iteration], loss)


def test_tp2_without_sequence_parallel_adds_it_and_trains_as_one_process(tmp_path):
    """Megatron's MoE layer refuses tensor parallelism without sequence parallelism at the first step, on every
    rank: zaya-pretrain adds --sequence-parallel and says so."""
    flags = QUICK + ["--train-iters", "3", "--save-interval", "1000"]
    one = pretrain(flags + ["--save", str(tmp_path / "one")], cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    two = pretrain(flags + ["--tensor-model-parallel-size", "2", "--save", str(tmp_path / "tp2")], cwd=tmp_path,
                   nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("[zaya] --tensor-model-parallel-size 2 with ZAYA1's experts needs sequence parallelism: "
                            "added --sequence-parallel") == 1, two.stdout[-3000:]
    expected, got = _loss_csv(tmp_path / "one" / "loss.csv"), _loss_csv(tmp_path / "tp2" / "loss.csv")
    assert sorted(got) == sorted(expected) == [1, 2, 3]
    for iteration, loss in expected.items():
        assert abs(got[iteration] - loss) <= 1e-5 * loss, (iteration, got[iteration], loss)
