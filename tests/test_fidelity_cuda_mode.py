"""`bench/fidelity.py --cuda` in emulation: the GPU fidelity check's own code path on CPU at a tiny
width (the figures are CPU figures; bench/gpu_check.sh runs it on a GPU at width 4096)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.torch
ROOT = Path(__file__).resolve().parent.parent
HEADER = "| section | quantity | predicted / preset | measured | measured / predicted |"


@pytest.mark.parametrize("fraction", [0.5, 1.0], ids=["solver-offloads", "solver-needs-no-offload"])
def test_cuda_mode_runs_on_cpu_and_prints_the_table_with_finite_figures(tmp_path, fraction):
    """At half the way to 1F1B's peak the solver's plan offloads; at 1F1B's peak it needs not, and the
    copies are measured on an offloading baseline's plan while the solver's runs beside it."""
    out = tmp_path / "fidelity_cuda.json"
    result = subprocess.run(
        [sys.executable, "bench/fidelity.py", "--cuda", "--device", "cpu", "--width", "128", "--seq", "128",
         "--blocks", "2", "--iterations", "1", "--repeats", "1", "--solve-s", "1", "--link-mib", "16",
         "--limit-fraction", str(fraction), "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("**CPU") and "width 128, seq 128" in lines[0]  # labelled with the device
    table = lines[lines.index(HEADER) + 2:]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table if line.startswith("|")]
    assert all(len(c) == 5 for c in cells)
    quantities = {(c[0], c[1].split(" (")[0]) for c in cells}
    for kind in ("F", "B", "W", "B+W", "OFFLOAD", "RELOAD"):
        assert ("ops", kind) in quantities, kind
    for quantity in ("rank's iteration, copy lanes", "same order, synchronous copies",
                     "overlap: synchronous minus lanes"):
        assert ("iteration", quantity) in quantities
    assert {"peak, the offload plan", "peak, ZB-H1 without offload", "saved by offload"} <= {
        q for s, q in quantities if s == "memory"}
    solver_rows = {s for s, q in quantities if q.startswith("rank's iteration, the solver's plan")
                   or q.startswith("peak, the solver's plan")}
    fallback = any("offloads nothing at this limit" in line for line in lines[:4])
    assert (solver_rows == {"iteration", "memory"}) == fallback == (fraction == 1.0)
    presets = [c[1] for c in cells if c[0] == "presets"]
    assert len(presets) == 7 and sum("host link" in q for q in presets) == 2

    doc = json.loads(out.read_text())
    assert doc["device_type"] == "cpu" and len(doc["rows"]) == len(cells)
    for row in doc["rows"]:
        assert math.isfinite(row["predicted"]) and math.isfinite(row["measured"]), row
        assert row["ratio"] is None or math.isfinite(row["ratio"])
    ops = {r["quantity"].split(" (")[0]: r for r in doc["rows"] if r["section"] == "ops"}
    assert ops["F"]["measured"] > 0 and ops["B+W"]["measured"] > 0 and ops["OFFLOAD"]["measured"] > 0
    assert all(v > 0 for v in doc["host_link_gbps"].values())
    assert doc["late"] == []  # the plan ran as planned: no copy or recompute on demand
