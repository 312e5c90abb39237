import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# Megatron compiles its fused bias-activation and bias-dropout-add functions (torch.compile) on their first
# call in every process: 1-4 s per CLI run or gloo rank, more than most tests' training steps take. The tests
# (and the subprocesses they start, which inherit this) run them uncompiled; each test's reference runs the
# same way. `make train` and real runs keep compiling.
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
