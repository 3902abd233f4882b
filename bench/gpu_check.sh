#!/usr/bin/env bash
# Issue 36 on a GPU, in one run: the runtime's CUDA paths (tests/test_cuda_runtime.py, marked cuda)
# and one Llama-like stage at width 4096 measured against its prediction (bench/fidelity.py --cuda).
#
# How the lead calls it (a session whose task has a device machine; status's can_start_another):
#   1. here, in the repository root, once:   bench/gpu_wheels.sh
#      (the device machine reaches no registry: pydantic, ortools, tenacity... travel as ~32 MB of
#      wheels in .whl/, which git ignores)
#   2. the device tool:   run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=460)
#      Took 91-116 s on an H100 and on an H200 (2026-11-28: wheels ~5 s, the CUDA tests 11-16 s,
#      the bench ~50 s at width 4096: profile, a 10-s solve, four plans' runs, the host-link copies),
#      212 s with GPU_CHECK_MORE="--width 8192", plus 35-125 s to start the machine; the plan is
#      timed with the preset named after the GPU. That leaves the session's 15 device minutes room
#      for one rerun; call give_back after the last.
#   3. what comes back ($OUT): gpu_check.log (everything), pytest_cuda.log, fidelity_cuda.md (the
#      table for docs/torch.md's "On a GPU"), fidelity_cuda.json (the same rows and the details).
#
# It assumes only the device image (python3 with CUDA PyTorch 2.11, numpy, pandas, httpx, rich,
# typer, pytest, pytest-timeout, setuptools) plus the carried wheels, and never installs from a
# network. Exit status: 0 when the tests and the bench both passed; 1 otherwise; 3 when pipeplan
# cannot be imported there (missing wheels).
set -x
set -o pipefail
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

# (a) the machine
nvidia-smi
python3 - <<'PY'
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(torch.cuda.get_device_name(0), f"{p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs,"
          f" capability {p.major}.{p.minor}, flash SDPA enabled: {torch.backends.cuda.flash_sdp_enabled()}")
PY

# (b) pipeplan's dependencies from the carried wheels, then pipeplan itself, editable (as
# pyproject.toml maps it: pipeplan.planner = planner/, ...; nothing fetched). Without a setuptools
# that builds editables, the same mapping as a finder that Python loads at start (sitecustomize).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
mkdir -p /tmp/site
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
if ! python3 -c "import pipeplan.planner" 2>/dev/null \
   && ! python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .; then
  cat > /tmp/site/sitecustomize.py <<PY
import importlib.machinery, sys
ROOT = "$PWD"
PARTS = {"planner", "service", "worker", "client", "migrations"}
class PipeplanParts:  # pyproject.toml's package-dir: pipeplan.<part> lives in <part>/
    @staticmethod
    def find_spec(name, path=None, target=None):
        head, _, part = name.partition(".")
        if head == "pipeplan" and part in PARTS:
            return importlib.machinery.PathFinder.find_spec(name, [ROOT])
        return None
sys.meta_path.append(PipeplanParts)
PY
fi
if ! python3 -c "import pydantic, ortools, tenacity, pipeplan.planner.solver, pipeplan.client.emulated_neighbours"; then
  echo "pipeplan does not import on this machine: run bench/gpu_wheels.sh in the repository root first and"
  echo "call run(..., carry=['.whl'])"
  exit 3
fi

# (c) the runtime's CUDA paths
timeout 150 python3 -m pytest -q -rs -m cuda -p no:cacheprovider tests/test_cuda_runtime.py 2>&1 | tee "$OUT/pytest_cuda.log"
tests=$?

# (d) one stage against its prediction (width 4096, 4 blocks, seq 4096, bf16, flash attention)
timeout 280 python3 bench/fidelity.py --cuda --iterations 5 --json "$OUT/fidelity_cuda.json" | tee "$OUT/fidelity_cuda.md"
bench=$?

# (e) optional, the same at other shapes: GPU_CHECK_MORE="--width 8192" runs it once more with
# those arguments added (results in fidelity_cuda_more.*)
if [ -n "${GPU_CHECK_MORE:-}" ]; then
  timeout 280 python3 bench/fidelity.py --cuda --iterations 5 $GPU_CHECK_MORE --json "$OUT/fidelity_cuda_more.json" \
    | tee "$OUT/fidelity_cuda_more.md" || bench=1
fi

set +x
echo "gpu_check: tests exit $tests, bench exit $bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
