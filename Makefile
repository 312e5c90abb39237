# The two commands of README.md, and the GPU suite. Each creates .venv (Python 3.12) and installs megatron-zaya
# when needed; `make test-gpu PYTHON=python3` uses an interpreter that has the packages already instead.
.PHONY: train test test-gpu

PYTHON ?= .venv/bin/python
VENV = $(if $(filter .venv/bin/python,$(PYTHON)),scripts/venv.sh,true)

# The main job: train the tiny ZAYA1 on the embedded corpus (CPU or GPU), write a checkpoint and a loss curve.
train:
	scripts/venv.sh
	.venv/bin/zaya-pretrain

# The test suite (CPU; GPU tests run only where CUDA is present). Three workers on a 2-core machine: with two, the
# cores idled a quarter of the time while workers waited on their tests' launches.
# Work stealing: otherwise one worker is handed the long CLI tests at the end of the collection while others idle.
test:
	scripts/venv.sh
	.venv/bin/python -m pytest -n 3 --dist worksteal --timeout 900 --durations 25 tests

# The GPU suite on one GPU: workers share it (most tests wait on the host), one per 20 GiB of its memory, up to six
# (a worker peaks at up to ~27 GiB, rarely at once); tests that share an uninterrupted run stay on one worker
# (xdist groups); then the tests that need the whole GPU, alone.
GPU_WORKERS = import torch; total = torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else 0; \
	print(min(6, max(1, total // (20 << 30))))

test-gpu:
	$(VENV)
	$(PYTHON) -m pytest -n $$($(PYTHON) -c "$(GPU_WORKERS)") --dist loadgroup --timeout 600 --durations 15 \
		-m "not whole_gpu" tests/gpu
	$(PYTHON) -m pytest --timeout 600 --durations 5 -m whole_gpu tests/gpu
