#!/usr/bin/env bash
# Run HERE (not on the device machine), in the repository root, before bench/gpu_check.sh.
#
# The device machine reaches no package registry. Its image has PyTorch (CUDA), numpy, pandas,
# httpx, rich, typer, pytest and pytest-timeout, but not pipeplan's pydantic, ortools or tenacity.
# This downloads them (and what they need beyond the image: ~32 MB) as wheels for the device's
# Python 3.12 on x86-64 into .whl/, which git ignores (.git/info/exclude) and `run` carries
# (carry=[".whl"]); bench/gpu_check.sh installs them there with pip --no-index.
# Versions: the ones this checkout's .venv holds (the ones the suite passes with).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude="$(git rev-parse --git-path info/exclude)"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
python=${PYTHON:-.venv/bin/python}
packages="pydantic pydantic-core annotated-types typing-inspection typing-extensions tenacity ortools protobuf
immutabledict absl-py"
pins=$("$python" - $packages <<'PY'
import importlib.metadata as m, sys
print(" ".join(f"{name}=={m.version(name)}" for name in sys.argv[1:]))
PY
)
rm -rf .whl && mkdir .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $pins
ls -l .whl && du -sh .whl
