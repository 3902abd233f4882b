"""What a user reads in the first hour (issue 38, items 8 and 9): a budget refused in the unit it was
given in, one wording for one infeasibility, help without stray types or cut sentences, one line
about torch's peers on a base install, transfer volumes without exponents, and a README tour that
plans under a real memory limit."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from core_schedules import make_problem
from typer.testing import CliRunner

from pipeplan.cli import COMMAND_MODULES, app
from pipeplan.commands.planning import _transfers

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


def _spec_at(tmp_path: Path, budget_gib: float) -> Path:
    spec = json.loads((ROOT / "examples" / "specs" / "llama7b_8xh100.json").read_text())
    spec["training"].update(offload=True, recompute=True, memory_budget_gib=budget_gib)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def test_a_budget_in_gib_is_refused_in_gib_in_the_same_words_by_every_command(tmp_path):
    spec = _spec_at(tmp_path, 14)
    said = {cmd: runner.invoke(app, [*cmd.split(), str(spec)]) for cmd in ("compare", "solve", "baseline 1f1b")}
    assert {r.exit_code for r in said.values()} == {2}
    lines = {r.stderr.strip() for r in said.values()}
    assert len(lines) == 1, lines  # solve, compare and baseline word it the same way
    line = lines.pop()
    assert line.startswith("error: infeasible: device 0 needs at least 16.4 GiB but its limit is 14.0 GiB;")
    assert "devices 1-6 need at least 14.4 GiB but their limit is 14.0 GiB" in line and "MiB" not in line
    assert line.endswith("any schedule needs at least 16.9 GiB per GPU, whatever the order, offload or recompute")
    # a problem document is written in MiB, and is answered in MiB
    problem = make_problem(p=2, m=4, static=1000.0, limit=1001.0)
    doc = tmp_path / "problem.json"
    doc.write_text(problem.model_dump_json())
    r = runner.invoke(app, ["solve", str(doc)])
    assert r.exit_code == 2 and "but their limit is 1001.0 MiB" in r.stderr and "GiB" not in r.stderr


def test_help_shows_no_stray_types_and_no_cut_sentences():
    top = runner.invoke(app, ["--help"], env={"COLUMNS": "80"})
    listed = top.stdout.split("Commands:")[1].strip().splitlines()
    groups = {group.name: group.typer_instance for group in app.registered_groups}
    assert len(listed) == len(app.registered_commands) + len(groups) >= len(COMMAND_MODULES)
    for line in listed:  # each command's line is one whole sentence
        assert line.rstrip().endswith(".") and not line.rstrip().endswith("..."), line
    commands = [[c.name] for c in app.registered_commands]
    commands += [[name, c.name] for name, sub in groups.items() for c in sub.registered_commands]
    for command in commands:
        shown = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "80"})
        assert shown.exit_code == 0 and "<bool>" not in shown.stdout, (command, shown.stdout)


def test_compare_on_a_base_install_says_once_that_torchs_peers_need_the_extra(tmp_path):
    doc = tmp_path / "problem.json"
    doc.write_text(make_problem(p=2, m=4).model_dump_json())
    without_torch = "import sys; sys.modules['torch'] = None; from pipeplan.cli import main; main()"
    r = subprocess.run([sys.executable, "-c", without_torch, "compare", str(doc)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env={"COLUMNS": "160", "PATH": "/usr/bin:/bin"}, check=False)
    assert r.returncode == 0, r.stderr
    assert "torch is not installed" not in r.stdout
    assert r.stdout.count("need the torch extra: pip install 'pipeplan[torch]'") == 1, r.stdout
    assert "torch-1f1b" in r.stdout and "torch-dualpipev" in r.stdout


def test_transfer_volumes_are_printed_without_exponents():
    plan = SimpleNamespace(offloaded_mib=1133.5 * 1024, host_memory_mib=[35.9 * 1024], recompute_ms=1234.5)
    assert _transfers("pipeoffload", plan) == \
        "pipeoffload offloads 1,134 GiB (host 35.9 GiB), recomputes 1,234 ms"


def test_the_readme_tour_plans_under_a_memory_limit_where_offload_and_recompute_are_at_work():
    from pipeplan.planner.baselines import DoesNotFit, best_heuristic, run_baseline
    from pipeplan.planner.documents import problem_from_document
    from pipeplan.planner.validator import validate_plan

    tour = (ROOT / "README.md").read_text().split("## A first plan")[1].split("\n## ")[0]
    spec_path = re.search(r"examples/specs/\S+?\.json", tour).group(0)
    spec = json.loads((ROOT / spec_path).read_text())
    assert '"memory_budget_gib"' in tour and spec["training"]["memory_budget_gib"] < 79.6
    problem = problem_from_document(spec)
    for name in ("1f1b", "zb-h1"):  # the limit binds: what keeps every activation on the GPU does not fit
        try:
            run_baseline(problem, name)
            raise AssertionError(f"{name} fits {spec_path}: the tour would show no memory planning")
        except DoesNotFit:
            pass
    assert run_baseline(problem, "pipeoffload").offloaded_mib > 0
    plan = best_heuristic(problem)
    assert validate_plan(problem, plan) == [] and plan.recompute_ms > 0
