"""The numeric flags whose range zaya-pretrain checks for Megatron (``arguments.FLAG_BOUNDS``): each is one of the
command's flags, a value just outside its range is refused in one line naming it, and the values at its bounds are
allowed. Through the CLI, with ZAYA1's and Muon's own ranges: tests/functional/test_bad_input.py."""

import pytest

from megatron_zaya.errors import UsageError
from megatron_zaya.training.arguments import FLAG_BOUNDS, Bounds, check_args, zaya_pretrain_parser
from megatron_zaya.training.command import build_argv

BASE = ["--mock-data", "--zaya-preset", "test", "--seq-length", "64", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "5"]


@pytest.fixture(scope="module")
def parser():
    return zaya_pretrain_parser()


def _outside(bounds: Bounds, step: float) -> list[float]:
    """Values one ``step`` outside ``bounds`` (at an exclusive bound, the bound)."""
    return [bounds.low - step] + ([] if bounds.high is None else [bounds.high if bounds.below else bounds.high + step])


def _inside(bounds: Bounds) -> list[float]:
    """The values at ``bounds`` that it allows."""
    return [bounds.low] + ([] if bounds.high is None or bounds.below else [bounds.high])


@pytest.mark.parametrize("flag", sorted(FLAG_BOUNDS))
def test_a_value_outside_the_bounds_is_refused_in_one_line_and_the_bounds_pass(flag, parser):
    bounds, kind = FLAG_BOUNDS[flag], parser._option_string_actions[flag].type
    assert kind in (int, float), (flag, kind)

    def parsed(value):
        return parser.parse_args(build_argv([*BASE, flag, str(kind(value))], cuda=False))

    for value in _outside(bounds, 1 if kind is int else 0.5):
        with pytest.raises(UsageError) as refused:
            check_args(parsed(value), 1)
        assert str(refused.value).startswith(f"{flag} {value:g}") and "\n" not in str(refused.value), refused.value
    for value in _inside(bounds):  # (other checks may refuse it with the rest of the command: not checked here)
        given = getattr(parsed(value), flag[2:].replace("-", "_"))
        assert given == value and bounds.problem(flag, given) is None, (flag, given)


def test_the_messages_name_the_range():
    assert Bounds(1).problem("--hidden-size", 0) == "--hidden-size 0: must be at least 1"
    assert Bounds(0, zero="no clipping").problem("--clip-grad", -1.0) == (
        "--clip-grad -1 is negative; give 0 or more (0: no clipping)")
    assert Bounds(0, 1).problem("--hidden-dropout", 1.5) == "--hidden-dropout 1.5: must be at least 0 and at most 1"
    assert Bounds(0, 1, below=True).problem("--adam-beta2", 1.0) == (
        "--adam-beta2 1: must be at least 0 and below 1")
    assert Bounds(1).problem("--num-query-groups", None) is None  # not given
