#!/usr/bin/env bash
# Create the Python 3.12 virtualenv in .venv at the repo root (if missing) and install megatron-zaya
# into it with its test extras. Idempotent: a second run only re-installs the package itself.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

find_python312() {
  local candidate
  for candidate in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  echo "error: no working python3.12 found; install Python 3.12 and put python3.12 on PATH" >&2
  return 1
}

if [ ! -x .venv/bin/python ]; then
  py=$(find_python312)
  echo "creating .venv with $py"
  "$py" -m venv .venv
fi
stamp=.venv/.megatron-zaya-installed
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[dev]"
  touch "$stamp"
fi
