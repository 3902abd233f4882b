"""Reuse of a neighbour's cached plan (planner/reuse.py, issue 40): for real-model cases and kinds of
change, revision 1 and the time-limited solve with and without reuse, each against the proven bound.

    .venv/bin/python bench/reuse.py                          # default cases, 10-s solves (~15 min)
    .venv/bin/python bench/reuse.py --quick                  # one small case, rev 1 only (seconds)
    .venv/bin/python bench/reuse.py --cases nemotron-h-8b-p32@70% --refine 60
    .venv/bin/python bench/reuse.py --service --quick        # the real service's POST, with and without

A case is a row of the real-model suite (bench/models.py: `--list` there names them). Its problem is
the *neighbour*: it is refined for `--refine` seconds first, as the cache would hold it (0: its
revision 1). Each change makes the *new* problem: budget +5% / -5% (every device's free memory,
limit - static, scaled), M x2 and M /2, costs +10% (every duration) and costs ±10% (each stage's
durations scaled by its own factor in [0.9, 1.1], seeded). Columns, in ms (gap to the bound in %):

- rev 1: the service's first plan today (pipeplan.service.inline.first_plan) and its seconds;
- reuse: planner.reuse.reuse_plan of the neighbour's refined plan, what it did and its seconds;
- rev 1 + reuse: what the service answers now (pipeplan.service.inline.first_choice with the
  neighbour in its cache: the faster of the two, the reuse within `inline_reuse_s`) and its seconds;
- @Ls: planner.solver.solve for `--limit` seconds hinted with rev 1 (the worker today), and hinted
  with rev 1 + reuse;
- bound: the best proven lower bound (planner.bounds, the memory bound, both solves' own).

Each case runs in a forked child. Figures depend on the machine's load: compare within one run.

`--service` measures the real service instead: two `pipeplan serve` processes (SQLite, no refine
worker), one with reuse off (`inline_reuse_s` 0); each caches the neighbour (POSTed, then its plan
refined for `--refine` s stored as the worker would store it), then every change is POSTed to both:
revision 1 and the POST's wall time, with and without the neighbour.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeplan.planner.contract import Plan, Problem

from bench.common import run_forked
from bench.model_suite import find
from bench.models import rows_of

DEFAULT_CASES = "qwen2.5-3b-p8-tied@70%,llama2-7b-p8@70%,gemma2-9b-p8-v-26gib,llama3-8b-p8-mixed-40-26"
QUICK_CASE = "qwen2.5-3b-p8-tied@70%"
CASE_TIMEOUT_S = 1800.0


def scaled_budget(problem: Problem, factor: float) -> Problem:
    """Every device's free memory (limit - static) times `factor`."""
    return problem.model_copy(update={"devices": [
        d.model_copy(update={"memory_limit_mib": d.static_mib + factor * (d.memory_limit_mib - d.static_mib)})
        for d in problem.devices]})


def scaled_costs(problem: Problem, spread: float, seed: int | None) -> Problem:
    """Every stage's durations times 1 + spread (seed None), or each stage's times its own factor
    drawn in [1 - spread, 1 + spread]: a recalibration from a measured run."""
    rng = random.Random(seed)
    fields = ("forward_ms", "backward_input_ms", "backward_weight_ms", "recompute_ms")
    stages = []
    for s in problem.stages:
        f = 1 + spread if seed is None else rng.uniform(1 - spread, 1 + spread)
        stages.append(s.model_copy(update={name: getattr(s, name) * f for name in fields}))
    return problem.model_copy(update={"stages": stages})


CHANGES: dict[str, Callable[[Problem], Problem]] = {
    "budget +5%": lambda p: scaled_budget(p, 1.05),
    "budget -5%": lambda p: scaled_budget(p, 0.95),
    "M x2": lambda p: p.model_copy(update={"num_microbatches": 2 * p.num_microbatches}),
    "M /2": lambda p: p.model_copy(update={"num_microbatches": max(1, p.num_microbatches // 2)}),
    "costs +10%": lambda p: scaled_costs(p, 0.1, None),
    "costs ±10%": lambda p: scaled_costs(p, 0.1, 1),
}


def case_problem(row_id: str) -> Problem:
    """The problem of the real-model suite's row `row_id` (e.g. "llama2-7b-p8@70%")."""
    name = row_id.split("@")[0]
    for row in rows_of(find(name)):
        if row.id == row_id:
            return row.problem()
    raise SystemExit(f"no row {row_id!r}; bench/models.py --list names them")


def measure_case(row_id: str, refine_s: float, limit_s: float, changes: list[str]) -> dict[str, Any]:
    """The neighbour refined, then one result per change (run in a forked child)."""
    from pipeplan.planner.solver import solve
    from pipeplan.service.inline import first_plan

    neighbour = case_problem(row_id)
    started = time.monotonic()
    if refine_s > 0:
        refined = solve(neighbour, refine_s, seed=0).plan
    else:
        refined = first_plan(neighbour, neighbour.key())
    out = {"neighbour_ms": refined.makespan_ms, "refine_s": time.monotonic() - started,
           "P": neighbour.num_devices, "S": neighbour.num_stages, "M": neighbour.num_microbatches, "rows": {}}
    for label in changes:
        problem = Problem.model_validate(CHANGES[label](neighbour).model_dump())
        out["rows"][label] = measure_change(problem, neighbour, refined, limit_s)
    return out


def measure_change(problem: Problem, neighbour: Problem, refined: Plan, limit_s: float) -> dict[str, Any]:
    """Revision 1 and the solves, without and with reuse, on one changed problem."""
    from pipeplan.planner.bounds import ALL, lower_bound
    from pipeplan.planner.reuse import reuse_plan
    from pipeplan.planner.solver import solve
    from pipeplan.planner.validator import assert_valid
    from pipeplan.service.inline import first_choice, first_plan

    from pipeplan.settings import Settings

    key = problem.key()
    started = time.monotonic()
    first = assert_valid(problem, first_plan(problem, key), key)
    first_s = time.monotonic() - started
    reuse = reuse_plan(problem, neighbour, refined, key)
    started = time.monotonic()
    served = first_choice(problem, key, neighbours=lambda: [(neighbour, refined)],
                          reuse_s=Settings().inline_reuse_s).plan
    served_s = time.monotonic() - started
    assert_valid(problem, served, key)
    r = {"first": first.makespan_ms, "first_s": first_s, "reuse": reuse.plan and reuse.plan.makespan_ms,
         "reuse_s": reuse.elapsed_s, "how": reuse.how, "reason": reuse.reason,
         "served": served.makespan_ms, "served_s": served_s,
         "bound": lower_bound(problem, ALL)}
    if limit_s > 0:
        cold = solve(problem, limit_s, hint=first, seed=0, problem_key=key)
        warm = solve(problem, limit_s, hint=served, seed=0, problem_key=key)
        r.update(cold=cold.plan.makespan_ms, warm=warm.plan.makespan_ms,
                 bound=max(r["bound"], cold.solver_bound_ms or 0.0, warm.solver_bound_ms or 0.0))
    return r


def cell(ms: float | None, bound: float, extra: str = "") -> str:
    if ms is None:
        return "-"
    gap = max(0.0, 100.0 * (ms / bound - 1)) if bound > 0 else float("nan")  # -0.0: float noise
    return f"{ms:,.1f} ({gap:.1f}%){extra}"


def header(limit_s: float) -> list[str]:
    cols = ["case", "change", "rev 1 (s)", "reuse (s): how", "rev 1 + reuse (s)"]
    if limit_s > 0:
        cols += [f"@{limit_s:g}s", f"@{limit_s:g}s + reuse"]
    cols.append("bound")
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]


def lines(row_id: str, result: dict[str, Any], limit_s: float) -> list[str]:
    if "error" in result:
        return [f"| {row_id} | error: {result['error'][:120]} |"]
    out = []
    for label, r in result["rows"].items():
        b = r["bound"]
        reuse = (cell(r["reuse"], b, f" ({r['reuse_s']:.2f} s): {r['how']}") if r["reason"] is None
                 else f"none ({r['reuse_s']:.2f} s): {r['reason'][:100]}")
        cells = [row_id, label, cell(r["first"], b, f" ({r['first_s']:.2f} s)"), reuse,
                 cell(r["served"], b, f" ({r['served_s']:.2f} s)")]
        if limit_s > 0:
            cells += [cell(r.get("cold"), b), cell(r.get("warm"), b)]
        cells.append(f"{b:,.1f}")
        out.append("| " + " | ".join(cells) + " |")
    return out


# -- the real service ---------------------------------------------------------------------------------
class Server:
    """`pipeplan serve` on a fresh SQLite file, no refine worker (the bench stores the refined plan)."""

    def __init__(self, folder: Path, **settings: object):
        import os
        import socket
        import subprocess

        import httpx

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env = {k: v for k, v in os.environ.items()
               if k not in ("PIPEPLAN_DATABASE_URL", "PIPEPLAN_REDIS_URL", "PIPEPLAN_API_KEYS")}
        env.update({"PIPEPLAN_DATA_DIR": str(folder), "PIPEPLAN_EMBEDDED_WORKERS": "0",
                    **{f"PIPEPLAN_{k.upper()}": str(v) for k, v in settings.items()}})
        self.url, self.db = f"http://127.0.0.1:{port}", f"sqlite:///{folder / 'pipeplan.db'}"
        self.proc = subprocess.Popen([str(Path(sys.executable).parent / "pipeplan"), "serve", "--port", str(port),
                                      "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        self.proc.kill()
        raise SystemExit("pipeplan serve did not start")

    def post(self, problem: Problem) -> tuple[dict, float]:
        """The POST's answer (its plan) and wall seconds."""
        import httpx

        started = time.monotonic()
        r = httpx.post(f"{self.url}/v1/plans", json={"problem": problem.model_dump(mode="json")}, timeout=300)
        r.raise_for_status()
        return r.json()["plan"], time.monotonic() - started

    def store(self, problem: Problem, plan: Plan) -> None:
        """A refined plan stored as the worker stores one (validated, if better)."""
        from pipeplan.service.db import make_engine
        from pipeplan.service.repository import Repository

        engine = make_engine(self.db, 1)
        Repository(engine).store_if_better(problem.key(), plan, problem)
        engine.dispose()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


def service_table(cases: list[str], changes: list[str], refine_s: float) -> list[str]:
    """Revision 1 of the real service (POST wall time) with reuse off and on, per case and change."""
    import tempfile

    from pipeplan.planner.bounds import ALL, lower_bound
    from pipeplan.planner.solver import solve

    table = ["| case | change | rev 1 without reuse (POST s) | rev 1 with the neighbour (POST s): method | bound |",
             "|---|---|---|---|---|"]
    print("\n".join(table), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        off = Server(Path(tmp) / "off", inline_reuse_s=0)
        on = Server(Path(tmp) / "on")
        try:
            for row_id in cases:
                neighbour = case_problem(row_id)
                for server in (off, on):
                    server.post(neighbour)
                if refine_s > 0:
                    refined = solve(neighbour, refine_s, seed=0, problem_key=neighbour.key()).plan
                    for server in (off, on):
                        server.store(neighbour, refined)
                for label in changes:
                    problem = Problem.model_validate(CHANGES[label](neighbour).model_dump())
                    bound = lower_bound(problem, ALL)
                    (a, a_s), (b, b_s) = off.post(problem), on.post(problem)
                    line = (f"| {row_id} | {label} | {cell(a['makespan_ms'], bound, f' ({a_s:.2f} s)')} | "
                            f"{cell(b['makespan_ms'], bound, f' ({b_s:.2f} s)')}: {b['method'][:60]} | {bound:,.1f} |")
                    table.append(line)
                    print(line, flush=True)
        finally:
            off.stop()
            on.stop()
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=DEFAULT_CASES,
                    help="comma-separated suite rows (bench/models.py --list)")
    ap.add_argument("--changes", default=",".join(CHANGES), help=f"comma-separated, of: {', '.join(CHANGES)}")
    ap.add_argument("--refine", type=float, default=10.0,
                    help="seconds the neighbour is solved for first (0: its revision 1 instead)")
    ap.add_argument("--limit", type=float, default=10.0, help="seconds of each solve (0: no solves)")
    ap.add_argument("--quick", action="store_true",
                    help=f"{QUICK_CASE} only, its revision 1 as the neighbour's plan, no solves")
    ap.add_argument("--out", type=Path, default=None, help="also write the Markdown table here")
    ap.add_argument("--service", action="store_true",
                    help="POST to two real `pipeplan serve` processes, reuse off and on (--quick: 2-s refine)")
    args = ap.parse_args(argv)
    cases = [QUICK_CASE] if args.quick else [c for c in args.cases.split(",") if c]
    refine, limit = (0.0, 0.0) if args.quick else (args.refine, args.limit)
    changes = [c.strip() for c in args.changes.split(",") if c.strip()]
    unknown = [c for c in changes if c not in CHANGES]
    if unknown:
        raise SystemExit(f"--changes: unknown {unknown}; choose from {', '.join(CHANGES)}")
    if args.service:
        table = service_table(cases, changes, 2.0 if args.quick else args.refine)
        if args.out:
            args.out.write_text("\n".join(table) + "\n")
        return 0
    table = header(limit)
    print("\n".join(table), flush=True)
    for row_id in cases:
        case_problem(row_id)  # a typo fails here, not in the child
        result = run_forked(measure_case, row_id, refine, limit, changes,
                            timeout_s=CASE_TIMEOUT_S + refine + 2 * limit * len(changes))
        rows = lines(row_id, result, limit)
        table += rows
        print("\n".join(rows), flush=True)
        if "error" not in result:
            print(f"[{row_id}: P={result['P']}, {result['S']} stages, M={result['M']}; the neighbour's plan"
                  f" {result['neighbour_ms']:,.1f} ms in {result['refine_s']:.1f} s]", file=sys.stderr,
                  flush=True)
    if args.out:
        args.out.write_text("\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
