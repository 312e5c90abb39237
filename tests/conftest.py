import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# Megatron compiles its fused bias-activation and bias-dropout-add functions (torch.compile) on their first
# call in every process: 1-4 s per CLI run or gloo rank, more than most tests' training steps take. The tests
# (and the subprocesses they start, which inherit this) run them uncompiled; each test's reference runs the
# same way. `make train` and real runs keep compiling.
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
# One compute thread per process (set before torch is imported; inherited by the CLI runs and gloo ranks):
# `make test` already keeps every core busy with one test per core, and a second OpenMP thread per process
# only spins at the barriers of the tiny models' ops. Measured on 2 loaded cores: a 6-step CLI run of the
# tiny preset used 41 s of CPU with two threads, 21-23 s with one.
os.environ.setdefault("OMP_NUM_THREADS", "1")
