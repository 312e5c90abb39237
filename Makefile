# The two commands of README.md. Both create .venv (Python 3.12) and install megatron-zaya when needed.
.PHONY: train test

# The main job: train the tiny ZAYA1 on the embedded corpus (CPU or GPU), write a checkpoint and a loss curve.
train:
	scripts/venv.sh
	.venv/bin/zaya-pretrain

# The test suite (CPU; GPU tests run only where CUDA is present). Work stealing: otherwise one worker is
# handed the long CLI tests at the end of the collection while the other idles.
test:
	scripts/venv.sh
	.venv/bin/python -m pytest -n 2 --dist worksteal --timeout 900 --durations 25 tests
