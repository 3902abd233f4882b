"""Real-model benchmark: cost-model problems of public architectures (bench/model_suite.py) at
1F1B's own peak memory, ~70% and ~50% of it, and on clusters with uneven memory; every peer schedule
against ours; prints a Markdown table.

    .venv/bin/python bench/models.py --out docs/models-table.md     # the full suite (~30 rows x 60 s)
    .venv/bin/python bench/models.py --quick                        # small cases, 2 s / 5 s
    .venv/bin/python bench/models.py --only llama2-13b --limits 10,60
    .venv/bin/python bench/models.py --list                         # row ids, for --only chunks
    .venv/bin/python bench/models.py --condense models.md           # the README's view of a table
    .venv/bin/python bench/models.py --first > first.txt            # first plans only (compare commits)

Budgets: 1F1B's peak is measured (the simulator's peak of run_baseline(problem, "1f1b")) on the same
model and devices in loop placement with one stage per device -- for V and interleaved cases too,
since that is the memory a 1F1B user of that model actually has. The budget is one uniform
memory_limit_mib (a cluster has one HBM size) = the max over devices of that peak x 100/70/50%;
below 100% offload and recompute are allowed. Rows are written to --out as they finish; rerunning
with the same --out skips the rows already there (resume). Each row runs in a forked child: the
peers, then one solve of the longest limit, the shorter limits read from its incumbent history.
How to read the table: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeplan.planner.baselines import NAMES, DoesNotFit, NotApplicable, best_heuristic, run_baseline
from pipeplan.planner.bounds import MemoryInfeasibleError, check_memory_feasible
from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.documents import problem_from_document
from pipeplan.planner.spec import HARDWARE

from bench.common import best_by, run_forked
from bench.model_suite import BUDGET_SHARES, SUITE, Case

GIB = 1024.0  # MiB
OURS = ("greedy",)  # our own heuristic (the solver's seed), not a peer
QUICK_SHARES = (1.0, 0.5)
ROW_TIMEOUT_S = 900.0  # on top of the solve limit: peers at P=32, M=128 take minutes


@dataclass(frozen=True)
class Row:
    """One problem of the table: a case at one budget."""

    case: Case
    limits_mib: tuple[float, ...]
    share: float | None  # of 1F1B's peak (uniform budgets)
    reference_mib: float  # 1F1B's peak, max over devices

    @property
    def id(self) -> str:
        return self.case.name if self.share is None else f"{self.case.name}@{round(100 * self.share)}%"

    @property
    def relaxed(self) -> bool:
        """Offload and recompute allowed: below 1F1B's peak, or where the case asks for them."""
        return self.case.offload if self.case.offload is not None else (self.share or 0.0) < 1.0

    def problem(self, microbatches: int | None = None) -> Problem:
        """The row's problem; `microbatches` rebuilds it with fewer (bench/gaps.py), all else equal."""
        spec = self.case.spec()
        if microbatches is not None:
            spec["training"]["microbatches"] = microbatches
        base = problem_from_document(spec)
        devices = [d.model_copy(update={"memory_limit_mib": lim})
                   for d, lim in zip(base.devices, self.limits_mib)]
        options = base.options.model_copy(update={"offload": self.relaxed and self.case.host_offload,
                                                  "recompute": self.relaxed})
        return base.model_copy(update={"devices": devices, "options": options})


def one_f_one_b_peak(case: Case) -> float:
    """1F1B's peak (MiB, max over devices) for the case's model on its devices, loop, one stage each,
    no memory limit: the reference the budgets are shares of."""
    ref = problem_from_document(case.spec(placement="loop", chunks=1))
    devices = [d.model_copy(update={"memory_limit_mib": None}) for d in ref.devices]
    free = ref.model_copy(update={"devices": devices})
    return max(run_baseline(free, "1f1b").peak_memory_mib)


def rows_of(case: Case, shares: tuple[float, ...] = BUDGET_SHARES) -> list[Row]:
    """The case's rows: one per share of 1F1B's peak (its own shares when it has them; the second half
    of an uneven case's devices at `case.uneven` of each), or its own fixed / per-device budget."""
    peak = one_f_one_b_peak(case)
    if case.shares is not None and shares == BUDGET_SHARES:
        shares = case.shares
    if case.budget_gib is None:
        half = case.devices // 2 if case.uneven is not None else case.devices
        small = case.uneven if case.uneven is not None else 1.0
        return [Row(case, (peak * s,) * half + (peak * s * small,) * (case.devices - half), s, peak)
                for s in shares]
    gib = case.budget_gib if isinstance(case.budget_gib, list) else [case.budget_gib] * case.devices
    return [Row(case, tuple(g * GIB for g in gib), None, peak)]


# --------------------------------------------------------------------------------------------------
# One row, computed in a forked child
# --------------------------------------------------------------------------------------------------
def offloaded_mib(problem: Problem, plan: Plan) -> float:
    """MiB copied to the host per iteration: the plan's own field when it has one, else the
    offloadable MiB of each OFFLOAD op's stage."""
    value = getattr(plan, "offloaded_mib", None)
    if value is not None:
        return float(value)
    return sum(problem.stages[op.stage].offloadable_mib or 0.0
               for dev in plan.devices for op in dev.ops if op.kind == "OFFLOAD")


def peer_cell(problem: Problem, name: str) -> tuple[str, float | None]:
    """(cell text, makespan if it fits): the makespan, "needs X GiB" or "n/a"."""
    try:
        ms = run_baseline(problem, name).makespan_ms
    except NotApplicable:
        return "n/a", None
    except DoesNotFit as exc:
        return f"needs {max(exc.needed_mib) / GIB:.1f} GiB", None
    except Exception as exc:  # noqa: BLE001 - one peer's failure must not lose the row
        return f"error: {type(exc).__name__}", None
    return f"{ms:,.0f}", ms


def measure(row: Row, limits: list[float]) -> dict[str, Any]:
    """Peers, then one solve of max(limits) seconds; everything a table row needs."""
    from pipeplan.planner.solver import solve

    problem = row.problem()
    try:
        check_memory_feasible(problem)
    except MemoryInfeasibleError as exc:
        return {"infeasible_mib": max(exc.needed_mib)}
    started = time.monotonic()
    peers = {name: peer_cell(problem, name) for name in NAMES}
    peers_s = time.monotonic() - started
    # the first plan a user gets is the service's revision 1, best_heuristic computed inline (the
    # solver's own stream opens with the serialized fallback, which no one would run)
    started = time.monotonic()
    first = best_heuristic(problem)
    first_s = time.monotonic() - started
    r = solve(problem, max(limits), seed=0, hint=first)
    return {
        "peers": peers, "peers_s": peers_s, "first": (first.makespan_ms, first_s),
        "at": {t: best_by(r.history, t) for t in limits[:-1]}, "final": r.plan.makespan_ms,
        "bound": max(r.plan.lower_bound_ms, r.solver_bound_ms or 0.0), "status": r.status,
        "method": r.plan.method, "offloaded_mib": offloaded_mib(problem, r.plan),
        "peak_mib": max(r.plan.peak_memory_mib),
    }


def first_plan(row: Row) -> dict[str, Any]:
    """The row's first plan: makespan (ms, unrounded, so any change shows) and method."""
    problem = row.problem()
    try:
        check_memory_feasible(problem)
    except MemoryInfeasibleError:
        return {}
    plan = best_heuristic(problem)
    return {"first_ms": plan.makespan_ms, "method": plan.method}


def run_row(row: Row, limits: list[float]) -> dict[str, Any]:
    """measure() in a forked child, so rows never share solver state or memory."""
    return run_forked(measure, row, limits, timeout_s=max(limits) + ROW_TIMEOUT_S)


# --------------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------------
def header(limits: list[float]) -> list[str]:
    cols = (["case", "P", "M", "placement", "budget"] + list(NAMES)
            + ["ours: first plan"] + [f"ours @{t:g}s" for t in limits]
            + ["proven bound", f"gap @{limits[-1]:g}s", "vs best peer", "offloaded GiB/iter"])
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]


def budget_cell(row: Row) -> str:
    """GiB per device (runs of equal budgets grouped) and the share(s) of 1F1B's peak."""
    runs = [(len(list(g)), lim) for lim, g in groupby(row.limits_mib)]
    gib = ", ".join(f"{n}×{lim / GIB:.1f}" if len(runs) > 1 else f"{lim / GIB:.1f}" for n, lim in runs)
    pct = "/".join(f"{100 * lim / row.reference_mib:.0f}%" for _, lim in runs)
    hbm = HARDWARE[row.case.hardware].hbm_gib * GIB
    over = " (> HBM)" if max(row.limits_mib) > hbm else ""
    return f"{gib} GiB ({pct}){over}"


def placement_cell(case: Case) -> str:
    return "V" if case.placement == "v" else ("loop" if case.chunks == 1 else f"loop ×{case.chunks}")


def markdown_row(row: Row, r: dict[str, Any], limits: list[float]) -> str:
    c = row.case
    head = [row.id, str(c.devices), str(c.microbatches), placement_cell(c), budget_cell(row)]
    tail_n = len(NAMES) + len(limits) + 5
    if "infeasible_mib" in r:
        cells = [f"infeasible: needs ≥ {r['infeasible_mib'] / GIB:.1f} GiB"] + ["-"] * (tail_n - 1)
    elif "error" in r:
        cells = [f"error: {r['error'][:80]}"] + ["-"] * (tail_n - 1)
    else:
        cells = solved_cells(r, limits)
    return "| " + " | ".join(head + cells) + " |"


def solved_cells(r: dict[str, Any], limits: list[float]) -> list[str]:
    peers = [r["peers"][n][0] for n in NAMES]
    fitting = [ms for n, (_, ms) in r["peers"].items() if ms is not None and n not in OURS]
    first_ms, first_s = r["first"]
    at = [f"{r['at'][t]:,.0f}" if r["at"].get(t) is not None else "-" for t in limits[:-1]]
    star = "*" if r["status"] == "optimal" else ""
    gap = 100 * (r["final"] / r["bound"] - 1) if r["bound"] > 0 else float("nan")
    vs = f"{min(fitting) / r['final']:.2f}×" if fitting else "none fits"
    return peers + [f"{first_ms:,.0f} ({first_s:.1f} s)"] + at + [
        f"{r['final']:,.0f}{star}", f"{r['bound']:,.0f}", f"{gap:.1f}%", vs,
        f"{r['offloaded_mib'] / GIB:,.0f}"]


def done_ids(out: Path, head: list[str]) -> set[str]:
    """Row ids already in `out` (resume); raises SystemExit if its header is another table's."""
    text = out.read_text() if out.exists() else ""
    if not text.strip():
        return set()
    if text.splitlines()[:2] != head:
        raise SystemExit(f"{out}: its header differs from this run's columns (other --limits or peers);"
                         " delete it or choose another --out")
    return {row[0] for row in parse(text)[1]}


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------
def select_rows(quick: bool, only: str | None) -> Iterator[Row]:
    """Rows in suite order; a case's 1F1B reference is computed only if one of its rows may match."""
    for case in SUITE:
        if (quick and not case.quick) or (only and only not in case.name and case.name not in only):
            continue
        for row in rows_of(case, QUICK_SHARES if quick else BUDGET_SHARES):
            if not only or only in row.id:
                yield row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limits", default=None,
                    help="comma-separated seconds; one solve of the largest (default 10,60)")
    ap.add_argument("--only", default=None, help="rows whose id (see --list) contains this text")
    ap.add_argument("--quick", action="store_true", help="small cases at 100%% and 50%%, limits 2,5")
    ap.add_argument("--out", type=Path, default=None, help="Markdown file; rows appended as they finish, "
                    "rows already in it skipped")
    ap.add_argument("--jobs", type=int, default=1, help="rows at once (default 1: the solver uses the cores)")
    ap.add_argument("--list", action="store_true", help="print the row ids and exit")
    ap.add_argument("--first", action="store_true", help="print each row's first plan (best_heuristic,"
                    " the service's revision 1) and exit: diff two commits' output to see a change's effect")
    ap.add_argument("--condense", type=Path, default=None, metavar="TABLE",
                    help="print the condensed view (fastest fitting peer only) of a table --out wrote")
    args = ap.parse_args(argv)
    if args.condense:
        table = args.condense.read_text()
        print(condense(table))
        print(f"\n{summary(table)}")
        return 0
    limits = sorted(float(x) for x in (args.limits or ("2,5" if args.quick else "10,60")).split(","))
    rows = list(select_rows(args.quick, args.only))
    if args.list:
        print("\n".join(r.id for r in rows))
        return 0
    if args.first:
        for row in rows:
            r = run_forked(first_plan, row, timeout_s=ROW_TIMEOUT_S)
            print(f"{row.id}\t{r.get('first_ms', r.get('error', 'infeasible'))}\t{r.get('method', '')}", flush=True)
        return 0
    head = header(limits)
    done = done_ids(args.out, head) if args.out else set()
    todo = [r for r in rows if r.id not in done]
    if len(todo) < len(rows):
        print(f"{args.out}: resuming, {len(rows) - len(todo)} of {len(rows)} rows already there",
              file=sys.stderr)
    if args.out and not done:
        args.out.write_text("\n".join(head) + "\n")
    print("\n".join(head), flush=True)
    run_all(todo, limits, args.jobs, args.out)
    print(f"\n{legend(limits)}", flush=True)
    return 0


def cells(line: str) -> list[str]:
    """The cells of one Markdown table row."""
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse(table: str) -> tuple[list[str], list[list[str]]]:
    """A Markdown table's column names and the cells of each row (separator lines and the header
    repeated by runs appended to one file left out)."""
    lines = [cells(line) for line in table.splitlines() if line.startswith("| ")]
    return lines[0], [row for row in lines[1:] if row[0] != lines[0][0]]


def condense(table: str) -> str:
    """The README's view of a full table: each row's fastest peer that fits (by name), then ours."""
    cols, rows = parse(table)
    first_peer, ours = cols.index(NAMES[0]), cols.index("ours: first plan")
    out = ["| case | budget | fastest fitting peer | " + " | ".join(cols[ours:]) + " |",
           "|" + "---|" * (3 + len(cols) - ours)]
    for row in rows:
        head = row[first_peer]
        if head.startswith(("infeasible", "error")):
            out.append(f"| {row[0]} | {row[4]} | {head} |" + " |" * (len(cols) - ours))
            continue
        fitting = [(float(v.replace(",", "")), n) for n, v in zip(cols[first_peer:ours], row[first_peer:ours])
                   if n not in OURS and v.replace(",", "").replace(".", "").isdigit()]
        peer = f"{min(fitting)[1]} {min(fitting)[0]:,.0f}" if fitting else "none fits"
        out.append(f"| {row[0]} | {row[4]} | {peer} | " + " | ".join(row[ours:]) + " |")
    return "\n".join(out)


def gaps(table: str) -> dict[str, float]:
    """Each solved row's gap (ours at the longest limit over the proven bound, percent) by id."""
    cols, rows = parse(table)
    at = next(i for i, c in enumerate(cols) if c.startswith("gap @"))
    return {row[0]: float(row[at][:-1]) for row in rows if len(row) > at and row[at].endswith("%")}


def summary(table: str, within: float = 2.0) -> str:
    """The headline of a table (issue 37): how many solved rows are within `within` % of their
    proven bound, and the geometric mean of ours / bound over all of them."""
    g = gaps(table)
    if not g:
        return "no solved rows"
    close = sum(v <= within for v in g.values())
    geo = math.exp(sum(math.log1p(v / 100) for v in g.values()) / len(g)) - 1
    return (f"{close} of {len(g)} solved rows within {within:g}% of the proven bound; "
            f"geometric-mean gap {100 * geo:+.2f}%")


def run_all(rows: list[Row], limits: list[float], jobs: int, out: Path | None) -> None:
    """Rows at `jobs` at a time; each printed and appended to `out` the moment it is done."""
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(run_row, row, limits): row for row in rows}
        for n, fut in enumerate(as_completed(futures), 1):
            row, r = futures[fut], fut.result()
            line = markdown_row(row, r, limits)
            print(line, flush=True)
            if out:
                with out.open("a") as f:
                    f.write(line + "\n")
            print(f"[{n}/{len(rows)} {time.monotonic() - started:6.0f}s] {row.id}: {progress(r)}",
                  file=sys.stderr, flush=True)


def progress(r: dict[str, Any]) -> str:
    if "final" not in r:
        return r.get("error") or f"infeasible (needs {r['infeasible_mib'] / GIB:.1f} GiB)"
    return (f"{r['final']:,.1f} ms ({r['method']}), bound {r['bound']:,.1f}, peers {r['peers_s']:.1f}s,"
            f" peak {r['peak_mib'] / GIB:.1f} GiB")


def legend(limits: list[float]) -> str:
    notes = "; ".join(f"{c.name}: {c.note}" for c in SUITE if c.note)
    return (f"ms per iteration. * = proven optimal. gap = ours @{limits[-1]:g}s / proven bound - 1. "
            f"vs best peer: fastest fitting peer (not {', '.join(OURS)}) / ours @{limits[-1]:g}s. "
            f"Reported in the issue: {notes}.")


if __name__ == "__main__":
    raise SystemExit(main())
