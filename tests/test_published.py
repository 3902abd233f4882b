"""bench/published.py on a few rows: the calibrated presets reproduce every calibration run, check
runs (dense, and a large MoE run whose passes outlast the host) stay within the bench's tolerance, the
published schedule pair comes out in its direction and ratio, and every run's data builds a problem
that fits its GPUs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeplan.planner.documents import problem_from_document

from bench.published import predict, summary
from bench.published_runs import FIGURES, RUNS, SCHEDULE_PAIR, find


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.id)
def test_every_run_is_a_consistent_configuration(run):
    assert run.gpus % (run.tp * run.cp * run.pp) == 0
    assert run.gbs % (run.mbs * run.dp) == 0, "global batch = microbatches x micro-batch x dp"
    problem = problem_from_document(run.spec())
    assert problem.num_stages == run.pp * run.vp and problem.num_microbatches == run.microbatches
    assert problem.workload.gpus == run.gpus
    assert problem.workload.tokens == run.gbs * run.seq
    assert run.calibrates in ("", *FIGURES)


def test_each_figure_is_fitted_on_exactly_one_run():
    assert sorted(r.calibrates for r in RUNS if r.calibrates) == sorted(FIGURES)


def test_the_schedule_pair_and_its_calibration_run():
    one, inter = (predict(find(i)) for i in SCHEDULE_PAIR)
    assert one.run.calibrates == "clock"
    assert one.tokens == pytest.approx(one.run.measured, rel=0.01)  # the preset is the fit
    measured = inter.run.measured / one.run.measured
    assert inter.tokens > one.tokens
    assert abs(inter.tokens / one.tokens - measured) <= 0.10
    assert one.fits and inter.fits
    assert any("Schedule pair" in line for line in summary([one, inter]))


@pytest.mark.parametrize("run", [r for r in RUNS if r.calibrates], ids=lambda r: r.calibrates)
def test_the_presets_are_the_fit(run):
    """Each fitted figure (planner/spec.py, bench/published_runs.py) meets its own run."""
    assert predict(run).tokens == pytest.approx(run.measured, rel=0.01)


@pytest.mark.parametrize("run_id", ["llama2-13b", "deepseek-v3", "gpt-oss-120b-gbs1280"])
def test_check_runs_are_within_the_bench_tolerance(run_id):
    p = predict(find(run_id))
    assert not p.run.calibrates and abs(p.error) <= 0.25 and p.fits


def test_a_left_out_run_is_printed_apart_and_counted_in_no_summary():
    """A row whose table contradicts its recipe says so, and the checks' figures leave it out."""
    apart, check = predict(find("qwen3-30b-a3b-vp24")), predict(find("llama2-13b"))
    assert apart.run.left_out and apart.run.role == "left out" and not apart.run.calibrates
    lines = summary([apart, check])
    assert lines[0].startswith("Checks (rows not used for calibration): 1;")
    assert lines[-1].startswith("Left out of the summary: qwen3-30b-a3b-vp24,")
    assert [r.id for r in RUNS if r.left_out] == ["qwen3-30b-a3b-vp24"]
