"""examples/train_pipeline.py end to end: 4 gloo ranks, a real plan source, a mid-run swap, and the
gradients of every step equal to a single-process reference (the example exits 1 otherwise)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("numpy", reason="gloo's shape inference needs numpy")

from service_proc import ROOT, Service

pytestmark = [pytest.mark.torch, pytest.mark.integration]


def run_example(tmp_path: Path, *extra: str) -> dict:
    report = tmp_path / "report.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PIPEPLAN_CLIENT_CACHE_DIR": str(tmp_path / "plans")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_pipeline.py"), "--steps", "3", "--swap-at", "1",
         "--microbatches", "4", "--tight-memory", "--report", str(report), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(report.read_text())


def check(result: dict) -> None:
    steps = result["steps"]
    assert len(steps) == 3
    assert all(s["max_grad_diff"] <= 1e-6 for s in steps)
    assert all(s["late"] == [] for s in steps)
    assert any(s["swapped"] for s in steps[1:]), "no improved revision was swapped in mid-run"
    assert steps[-1]["revision"] > steps[0]["revision"]
    # the tight limits make the plans drop activations: the executor ran them
    assert all(s["recomputed"] or s["offloaded"] for s in steps)


def test_example_with_the_embedded_solver(tmp_path):
    check(run_example(tmp_path, "--time-budget", "2"))


def test_example_with_plans_from_a_running_service(tmp_path):
    svc = Service(tmp_path).start()
    try:
        result = run_example(tmp_path, "--url", svc.url, "--time-budget", "2")
    finally:
        svc.stop()
    check(result)
