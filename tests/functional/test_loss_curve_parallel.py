"""The loss curve of a data-parallel run is the whole batch's loss, not the writing rank's share of it; and DP2
with zaya_muon's ZeRO-1 sharding under Megatron's overlap flags, and TP2 (Adam, zaya_muon), train as one process
does."""

from __future__ import annotations

from zaya_cli import KILLED_RUN, MUON_RUN, loss_csv, pretrain

DISTRIBUTED = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]


def test_dp2_loss_curve_equals_one_process(muon_run, tmp_path):
    two = pretrain(MUON_RUN + DISTRIBUTED + ["--exit-interval", "3", "--save", str(tmp_path / "two")], cwd=tmp_path,
                   nproc=2)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    expected, got = loss_csv(muon_run / "full" / "loss.csv"), loss_csv(tmp_path / "two" / "loss.csv")
    assert sorted(got) == [1, 2, 3]
    for iteration in got:
        assert abs(got[iteration] - expected[iteration]) <= 1e-5 * expected[iteration], (iteration, got, expected)


def test_tp2_without_sequence_parallel_adds_it_and_trains_as_one_process(uninterrupted, tmp_path):
    """Megatron's MoE layer refuses tensor parallelism without sequence parallelism at the first step, on every
    rank: zaya-pretrain adds --sequence-parallel and says so; the first steps are the one-process run's."""
    two = pretrain(KILLED_RUN + ["--tensor-model-parallel-size", "2", "--exit-interval", "3", "--save-interval",
                                 "1000", "--save", str(tmp_path / "tp2")], cwd=tmp_path, nproc=2)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("[zaya] --tensor-model-parallel-size 2 with ZAYA1's experts needs sequence parallelism: "
                            "added --sequence-parallel") == 1, two.stdout[-3000:]
    got = loss_csv(tmp_path / "tp2" / "loss.csv")
    assert sorted(got) == [1, 2, 3]
    for iteration in got:
        assert abs(got[iteration] - uninterrupted[iteration]) <= 1e-5 * uninterrupted[iteration], (iteration, got)


def test_tp2_with_zaya_muon_trains_as_one_process(muon_run, tmp_path):
    """Under TP2 each rank holds its rows of every expert's [gate; up] matrix (Megatron's stride-2 GLU layout):
    Muon orthogonalises the gathered matrices, and the first steps are the one-process run's."""
    two = pretrain(MUON_RUN + ["--tensor-model-parallel-size", "2", "--exit-interval", "3", "--save",
                               str(tmp_path / "tp2")], cwd=tmp_path, nproc=2)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    expected, got = loss_csv(muon_run / "full" / "loss.csv"), loss_csv(tmp_path / "tp2" / "loss.csv")
    assert sorted(got) == [1, 2, 3]
    for iteration in got:
        assert abs(got[iteration] - expected[iteration]) <= 1e-5 * expected[iteration], (iteration, got, expected)
