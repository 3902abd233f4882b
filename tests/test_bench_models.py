"""bench/models.py and its suite: every spec builds, the budgets are 1F1B's peak and shares of it, and
the script prints (and resumes) its Markdown table end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeplan.planner.baselines import NAMES, DoesNotFit, run_baseline
from pipeplan.planner.documents import problem_from_document
from support.models_table import models_table

from bench.model_suite import SUITE, find
from bench.models import condense, gaps, header, offloaded_mib, rows_of, summary

SMALL = "qwen2.5-3b-p8-tied"


@pytest.mark.parametrize("case", SUITE, ids=lambda c: c.name)
def test_every_spec_builds_the_pipeline_it_names(case) -> None:
    problem = problem_from_document(case.spec())
    chunks = 2 if case.placement == "v" else case.chunks
    assert problem.num_devices == case.devices
    assert problem.num_microbatches == 4 * case.devices
    assert problem.num_stages == case.devices * chunks
    assert problem.metadata["placement"] == case.placement


def test_suite_covers_the_issue() -> None:
    families = {c.model["name"] for c in SUITE}
    assert len(families) >= 8
    assert {c.devices for c in SUITE} == {8, 16, 32}
    assert sum(c.devices == 32 for c in SUITE) <= 3
    assert {c.placement for c in SUITE} == {"loop", "v"}
    assert any(isinstance(c.budget_gib, list) and len(set(c.budget_gib)) > 1 for c in SUITE)
    assert any(c.model.get("experts") for c in SUITE) and any(c.model.get("mtp_heads") for c in SUITE)
    assert any("pattern" in c.model for c in SUITE) and any(c.model.get("tie_embeddings") for c in SUITE)


@pytest.mark.parametrize("name", ["llama2-7b-p8", SMALL])
def test_budgets_are_1f1b_peak_and_shares_of_it(name: str) -> None:
    full, seventy, half = rows_of(find(name))
    assert (full.share, seventy.share, half.share) == (1.0, 0.7, 0.5)
    assert full.limits_mib[0] == pytest.approx(full.reference_mib)
    assert half.limits_mib[0] == pytest.approx(0.5 * full.reference_mib)
    assert not full.relaxed and seventy.relaxed and half.relaxed
    assert run_baseline(full.problem(), "1f1b").makespan_ms > 0  # fits its own peak
    with pytest.raises(DoesNotFit):
        run_baseline(half.problem(), "1f1b")
    assert half.problem().options.offload and half.problem().options.recompute


def test_uneven_cluster_keeps_its_per_device_budgets() -> None:
    (row,) = rows_of(find("llama3-8b-p8-mixed-40-26"))
    assert [lim / 1024 for lim in row.limits_mib] == [40.0] * 4 + [26.0] * 4
    assert row.share is None and row.relaxed


def test_issue_37_families_are_three_feasible_budgets_each() -> None:
    """Long context with recompute only, fine-grained MoE, two memory sizes, 16-device V with a 256k
    vocabulary: three rows each, every one above the least memory any schedule needs."""
    from pipeplan.planner.bounds import min_memory

    for name in ("llama3.1-8b-32k-p8-rc", "qwen3-30b-a3b-p8", "mistral-nemo-12b-p8-uneven", "gemma2-9b-p16-v"):
        rows = rows_of(find(name))
        assert len(rows) == 3
        for row in rows:
            problem = row.problem()
            assert all(n <= problem.limit_of(d) + 1e-9 for d, n in enumerate(min_memory(problem))), row.id
    assert find("llama3.1-8b-32k-p8-rc").model["seq_len"] == 32768
    assert find("qwen3-30b-a3b-p8").model["experts"] == 128 and find("qwen3-30b-a3b-p8").model["top_k"] == 8
    assert find("gemma2-9b-p16-v").model["vocab"] >= 256000 and find("gemma2-9b-p16-v").devices == 16


def test_recompute_only_rows_allow_no_offload() -> None:
    full, seventy, half = rows_of(find("llama3.1-8b-32k-p8-rc"))
    assert not full.problem().options.recompute and not full.problem().options.offload
    for row in (seventy, half):
        options = row.problem().options
        assert options.recompute and not options.offload


def test_uneven_family_gives_the_second_half_half_the_memory() -> None:
    rows = rows_of(find("mistral-nemo-12b-p8-uneven"))
    for row in rows:
        big, small = row.limits_mib[0], row.limits_mib[-1]
        assert row.limits_mib == (big,) * 4 + (small,) * 4 and small == pytest.approx(big / 2)
        assert big == pytest.approx(row.share * row.reference_mib)
    assert [r.share for r in rows] == [1.5, 1.25, 1.0]


def test_fewer_microbatches_rebuild_the_same_problem() -> None:
    row = rows_of(find(SMALL))[1]
    full, small = row.problem(), row.problem(microbatches=8)
    assert small.num_microbatches == 8 and full.num_microbatches == 32
    assert small.stages == full.stages and small.devices == full.devices and small.options == full.options


def test_offloaded_mib_falls_back_to_the_offload_ops() -> None:
    problem = problem_from_document(find(SMALL).spec())
    ops = [SimpleNamespace(kind="OFFLOAD", stage=2), SimpleNamespace(kind="F", stage=2),
           SimpleNamespace(kind="OFFLOAD", stage=3)]
    plan = SimpleNamespace(devices=[SimpleNamespace(ops=ops)])  # no offloaded_mib field
    want = problem.stages[2].offloadable_mib + problem.stages[3].offloadable_mib
    assert offloaded_mib(problem, plan) == pytest.approx(want)


def test_script_prints_and_resumes_its_table(tmp_path: Path) -> None:
    out = tmp_path / "t.md"
    cmd = [sys.executable, str(ROOT / "bench" / "models.py"), "--quick", "--only", f"{SMALL}@100%",
           "--limits", "1,2", "--out", str(out)]
    first = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert first.returncode == 0, first.stderr
    head = header([1.0, 2.0])[0]
    assert head in first.stdout
    for col in [*NAMES, "ours: first plan", "ours @1s", "ours @2s", "proven bound", "gap @2s",
                "vs best peer", "offloaded GiB/iter"]:
        assert f"| {col} |" in head
    rows = [line for line in out.read_text().splitlines() if line.startswith(f"| {SMALL}@100% |")]
    assert len(rows) == 1 and rows[0].count("|") == head.count("|")
    assert "%" in rows[0].split("|")[-4]  # the gap cell is a number, not an error
    again = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert again.returncode == 0 and "1 of 1 rows already there" in again.stderr
    assert out.read_text().count(f"| {SMALL}@100% |") == 1


def test_condense_keeps_the_fastest_fitting_peer_and_ours() -> None:
    head = header([10.0, 60.0])
    cols = [c.strip() for c in head[0].strip("|").split("|")]
    peers = {n: "n/a" for n in NAMES}
    peers |= {"1f1b": "2,000", "zb-h1": "needs 90.0 GiB", "greedy": "1,500", "pipeoffload": "1,900"}
    solved = ["r@100%", "8", "32", "loop", "20.0 GiB (100%)", *peers.values(),
              "1,600 (0.1 s)", "1,550", "1,500*", "1,500", "0.0%", "1.27×", "0"]
    infeasible = ["r@50%", "8", "32", "loop", "10.0 GiB (50%)", "infeasible: needs ≥ 12.0 GiB"]
    infeasible += ["-"] * (len(cols) - len(infeasible))
    table = "\n".join(head + ["| " + " | ".join(r) + " |" for r in (solved, infeasible)])
    lines = condense(table).splitlines()
    assert lines[2] == "| r@100% | 20.0 GiB (100%) | pipeoffload 1,900 | 1,600 (0.1 s) | 1,550 | 1,500* | 1,500 |" \
                       " 0.0% | 1.27× | 0 |"
    assert lines[3].startswith("| r@50% | 10.0 GiB (50%) | infeasible: needs ≥ 12.0 GiB |")


def test_summary_counts_rows_within_two_percent_and_the_geometric_mean_gap() -> None:
    table = models_table({"a@100%": "0.0%", "b@70%": "2.0%", "c@50%": "21.0%", "d@50%": "-"})  # d: infeasible
    table += "\n" + header([10.0, 60.0])[0]  # a header repeated (rows appended by several runs)
    assert gaps(table) == {"a@100%": 0.0, "b@70%": 2.0, "c@50%": 21.0}
    # (1.00 x 1.02 x 1.21) ** (1/3) = 1.0727
    assert summary(table) == "2 of 3 solved rows within 2% of the proven bound; geometric-mean gap +7.27%"
