"""The command line's defaults: a run resumes from the directory it saves to (the embedded main job's is its
run directory); a run without --lr trains at ZAYA1's default peak learning rate."""

from megatron_zaya.training.arguments import zaya_pretrain_parser
from megatron_zaya.training.command import EMBEDDED_RUN_DIR, build_argv


def _resolved(argv, dest):
    return getattr(zaya_pretrain_parser().parse_args(build_argv(argv, cuda=False)), dest)


def test_the_default_run_saves_and_resumes_in_its_own_directory():
    assert _resolved([], "save") == _resolved([], "load") == EMBEDDED_RUN_DIR


def test_load_follows_an_explicit_save():
    assert _resolved(["--save", "/tmp/elsewhere"], "load") == "/tmp/elsewhere"
    assert _resolved(["--mock-data", "--save", "/tmp/elsewhere"], "load") == "/tmp/elsewhere"
    assert _resolved(["--mock-data", "--save", "/tmp/elsewhere", "--zaya-overwrite-save"], "load") is None
    assert _resolved(["--mock-data"], "load") is None  # nothing to resume from


def test_an_explicit_load_wins():
    argv = ["--save", "/tmp/new", "--load", "/tmp/old"]
    assert (_resolved(argv, "save"), _resolved(argv, "load")) == ("/tmp/new", "/tmp/old")


def test_sigterm_saves_whenever_there_is_a_save_directory():
    mock = ["--mock-data", "--zaya-preset", "test"]
    assert "--exit-signal-handler" in build_argv([], cuda=False)  # the main job saves into its run directory
    assert "--exit-signal-handler" in build_argv([*mock, "--save", "ck"], cuda=False)
    assert "--exit-signal-handler" not in build_argv([*mock, "--save", "ck", "--zaya-sigterm-deadline", "0"],
                                                     cuda=False)
    assert "--exit-signal-handler" not in build_argv(mock, cuda=False)  # nothing to save into


def test_a_shorter_main_job_gets_a_warmup_that_fits():
    assert _resolved(["--train-iters", "20"], "lr_warmup_iters") == 2
    assert _resolved(["--train-iters", "1000"], "lr_warmup_iters") == 20
    assert _resolved(["--train-iters", "20", "--lr-warmup-iters", "5"], "lr_warmup_iters") == 5


def test_a_run_without_lr_takes_the_default_peak_and_an_explicit_one_wins():
    mock = ["--mock-data", "--zaya-preset", "zaya1-8b", "--train-iters", "8"]
    assert _resolved(mock, "lr") == 2e-3  # docs/architecture.md's recipe
    assert _resolved([*mock, "--lr", "1e-4"], "lr") == 1e-4
    assert _resolved([], "lr") == 3e-3  # the main job's own


def test_save_empty_means_no_checkpoints_even_for_the_main_job():
    argv = build_argv(["--save", ""], cuda=False)
    assert _resolved(["--save", ""], "save") == "" and _resolved(["--save", ""], "load") is None
    assert "--exit-signal-handler" not in argv  # nothing to save on SIGTERM
