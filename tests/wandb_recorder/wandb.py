"""Stands in for the ``wandb`` package, which the test environment does not install, on a subprocess's
PYTHONPATH: every ``log(values, step)`` that Megatron's W&B writer makes is appended to the JSON-lines file
``$ZAYA_WANDB_RECORD``; the calls that talk to the W&B service (runs, artifacts) do nothing."""

import json
import os
from types import SimpleNamespace


class Artifact:
    def __init__(self, *args, **kwargs):
        pass

    def add_reference(self, *args, **kwargs):
        pass

    def add_file(self, *args, **kwargs):
        pass


run = SimpleNamespace(entity="test", project="test", log_artifact=lambda *a, **k: None, use_artifact=lambda *a: None)
config = SimpleNamespace(update=lambda *a, **k: None)


def init(**kwargs):
    pass


def log(values: dict, step: int | None = None):
    with open(os.environ["ZAYA_WANDB_RECORD"], "a") as record:
        record.write(json.dumps({"step": step, **values}) + "\n")


def finish():
    pass
