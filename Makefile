# The two commands of README.md, and the GPU suite. Each creates .venv (Python 3.12) and installs megatron-zaya
# when needed; `make test-gpu PYTHON=python3` uses an interpreter that has the packages already instead.
.PHONY: train test test-gpu

PYTHON ?= .venv/bin/python
VENV = $(if $(filter .venv/bin/python,$(PYTHON)),scripts/venv.sh,true)

# The main job: train the tiny ZAYA1 on the embedded corpus (CPU or GPU), write a checkpoint and a loss curve.
train:
	scripts/venv.sh
	.venv/bin/zaya-pretrain

# The test suite (CPU; GPU tests run only where CUDA is present). Work stealing: otherwise one worker is
# handed the long CLI tests at the end of the collection while the other idles.
test:
	scripts/venv.sh
	.venv/bin/python -m pytest -n 2 --dist worksteal --timeout 900 --durations 25 tests

# The GPU suite on one GPU: six workers share it (most tests wait on the host), tests that share an
# uninterrupted run stay on one worker (xdist groups); then the tests that need the whole GPU, alone.
test-gpu:
	$(VENV)
	$(PYTHON) -m pytest -n 6 --dist loadgroup --timeout 600 --durations 15 -m "not whole_gpu" tests/gpu
	$(PYTHON) -m pytest --timeout 600 --durations 5 -m whole_gpu tests/gpu
