"""What the dashboard pages show, assembled from the repository and the planner (no HTTP here).

Baseline figures (1F1B at the same memory, and the whole `compare` table) depend only on the
problem, so they are computed once per key and kept in a bounded in-process cache rather than
recomputed per page view. Rendered SVGs are cached per (key, revision): a revision never changes.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from pipeplan.planner.contract import Plan, Problem

from . import views


class _LRU:
    """A small thread-safe LRU; values are computed outside the lock (two threads may race to fill).

    At most `size` entries and, when `weight` is given, at most `max_weight` in all (the newest entry
    is always kept)."""

    def __init__(self, size: int, max_weight: float = math.inf, weight: Callable[[Any], float] | None = None):
        self.size = size
        self.max_weight = max_weight
        self._weight = weight or (lambda _: 0.0)
        self._data: OrderedDict[Any, Any] = OrderedDict()
        self._weights: dict[Any, float] = {}
        self._total = 0.0
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                return self._data[key]
        return None

    def contains(self, key: Any) -> bool:
        with self._lock:
            return key in self._data

    def put(self, key: Any, value: Any) -> None:
        weight = self._weight(value)
        with self._lock:
            self._total += weight - self._weights.get(key, 0.0)
            self._data[key], self._weights[key] = value, weight
            self._data.move_to_end(key)
            while len(self._data) > 1 and (len(self._data) > self.size or self._total > self.max_weight):
                old, _ = self._data.popitem(last=False)
                self._total -= self._weights.pop(old)

    def get_or_compute(self, key: Any, compute: Callable[[], Any]) -> Any:
        found = self.get(key)
        if found is not None:
            return found
        value = compute()
        self.put(key, value)
        return value


# -- baselines ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OneF1B:
    """1F1B on the same problem: its makespan, or why there is none."""

    makespan_ms: float | None
    note: str  # "" when there is a makespan; else "1F1B OOM", "n/a", …
    detail: str = ""  # why there is none; or, with a makespan, which schedule ("interleaved 1F1B")
    hardware: str = ""  # the cost model's hardware name, when the problem came from a spec


def hardware_of(problem: Problem) -> str:
    meta = problem.metadata if isinstance(problem.metadata, dict) else {}
    hw = meta.get("hardware")
    return str(hw.get("name", "")) if isinstance(hw, dict) else str(hw or "")


@dataclass(frozen=True)
class BaselineRow:
    name: str
    makespan_ms: float | None
    peak_mib: float | None
    reason: str


def _baselines_module():
    try:
        from pipeplan.planner import baselines
    except ImportError:  # the baselines helper's module is not there (yet): say so on the page
        return None
    return baselines if hasattr(baselines, "run_baseline") else None


def compute_one_f_one_b(problem: Problem) -> OneF1B:
    figure = _one_f_one_b(problem)
    return OneF1B(figure.makespan_ms, figure.note, figure.detail, hardware_of(problem))


def _one_f_one_b(problem: Problem) -> OneF1B:
    """1F1B, or with several stages per device its interleaved form (Megatron's schedule for them)."""
    mod = _baselines_module()
    if mod is None:
        return OneF1B(None, "n/a", "planner.baselines is not installed")
    name = "1f1b" if problem.chunks == 1 else "interleaved-1f1b"
    label = "1F1B" if name == "1f1b" else "interleaved 1F1B"
    try:
        plan = mod.run_baseline(problem, name)
    except getattr(mod, "DoesNotFit", ()) as exc:
        return OneF1B(None, "1F1B OOM", f"{label} {exc.summary(problem)}")
    except getattr(mod, "NotApplicable", ()) as exc:
        return OneF1B(None, "n/a", f"{label} does not apply: {exc}")
    except Exception as exc:  # noqa: BLE001 — a baseline bug must not take the dashboard down
        return OneF1B(None, "error", f"{label} failed: {exc}")
    return OneF1B(plan.makespan_ms, "", label)


def _result_fields(result: Any) -> tuple[str, Plan | None, str]:
    """Read one `compare` entry, whether it is an object, a dict or a (name, plan_or_reason) pair."""
    if isinstance(result, dict):
        name, plan, reason = result.get("name"), result.get("plan"), result.get("reason")
    elif isinstance(result, tuple) and not hasattr(result, "_fields"):
        name, value = result[0], result[1]
        plan, reason = (value, None) if isinstance(value, Plan) else (None, value)
    else:
        name, plan, reason = (getattr(result, "name", "?"), getattr(result, "plan", None),
                              getattr(result, "reason", None))
    if isinstance(plan, dict):
        plan = Plan.model_validate(plan)
    return str(name), plan, "" if reason is None else str(reason)


def compute_baselines(problem: Problem) -> tuple[list[BaselineRow], str]:
    """Every baseline of planner.baselines.compare on the problem; a note when unavailable."""
    mod = _baselines_module()
    if mod is None or not hasattr(mod, "compare"):
        return [], "Baselines are not available (planner.baselines is not installed)."
    try:
        results = mod.compare(problem)
    except Exception as exc:  # noqa: BLE001 — the page still shows the plan without the table
        return [], f"Baselines failed: {exc}"
    rows = []
    for result in results:
        name, plan, reason = _result_fields(result)
        if plan is not None:
            rows.append(BaselineRow(name, plan.makespan_ms, max(plan.peak_memory_mib, default=0.0), ""))
        else:
            rows.append(BaselineRow(name, None, None, reason or "not applicable"))
    return rows, ""


class BaselineCache:
    """Per-key 1F1B figure and baseline table; a problem never changes under its key."""

    def __init__(self, size: int = 4096):
        self.one_f_one_b = _LRU(size)
        self.tables = _LRU(256)

    def one_f_one_b_of(self, key: str, problem: Problem) -> OneF1B:
        return self.one_f_one_b.get_or_compute(key, lambda: compute_one_f_one_b(problem))

    def table_of(self, key: str, problem: Problem) -> tuple[list[BaselineRow], str]:
        """The table, computed here when nobody has (the service computes it in a child process and
        hands it over with `put_table`)."""
        found = self.tables.get(key)
        return found if found is not None else self.put_table(key, problem, *compute_baselines(problem))

    def put_table(self, key: str, problem: Problem, rows: list[BaselineRow],
                  note: str) -> tuple[list[BaselineRow], str]:
        """Keep the table, and its 1F1B row as the key's 1F1B figure (not computed a second time)."""
        wanted = "1f1b" if problem.chunks == 1 else "interleaved-1f1b"
        label = "1F1B" if problem.chunks == 1 else "interleaved 1F1B"
        one = next((r for r in rows if r.name == wanted), None)
        if one is not None and not self.one_f_one_b.contains(key):
            hw = hardware_of(problem)
            self.one_f_one_b.put(key, OneF1B(one.makespan_ms, "", label, hw) if one.makespan_ms is not None
                                 else OneF1B(None, "1F1B OOM" if "fit" in one.reason.lower() else "n/a",
                                             one.reason, hw))
        self.tables.put(key, (rows, note))
        return rows, note


def build_baselines(job: dict[str, Any]) -> dict[str, Any]:
    """Child-process entry (service.inline.run_in_child): the key's baselines table, computed and
    written beside its exports (a P=64 M=512 problem's table is seconds of CPU and hundreds of MB that
    the API process must not spend). Returns {"rows": n, "note": ...} or {"error": {...}}."""
    from pathlib import Path

    from pipeplan.service.db import make_engine
    from pipeplan.service.exports_cache import write_baselines
    from pipeplan.service.repository import Repository

    engine = make_engine(job["database_url"], 1)
    try:
        problem = Repository(engine).get_problem(job["key"])
    finally:
        engine.dispose()
    if problem is None:
        return {"error": {"status": 404, "code": "not_found", "message": f"no problem for key {job['key']}",
                          "extra": {}}}
    rows, note = compute_baselines(problem)
    if rows and not note:
        write_baselines(Path(job["root"]), job["key"], [asdict(r) for r in rows])
    return {"rows": len(rows), "note": note}


# -- overview rows -------------------------------------------------------------------------------------

def _parse_time(value: Any) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    try:
        parsed = datetime.fromisoformat(str(value))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


@dataclass
class OverviewRow:
    key: str
    model: str
    devices: int
    microbatches: int
    chunks: int
    memory: str
    makespan: str
    bound: str
    gap: str
    bubble: str
    speedup: float | None
    speedup_note: str
    speedup_title: str
    revision: int
    job_state: str | None
    job_outcome: str | None  # how the last run ended (service.outcomes), for the badge's colour
    job_outcome_text: str | None  # the API's and CLI's words without the gap (the Gap column shows it)
    job_outcome_title: str | None  # the same with the gap, as the API and CLI say it
    status: str
    updated: str
    updated_iso: str
    pending: bool = False
    traced: str = ""  # measured vs predicted of the newest posted trace (dashboard.traces), "" if none


def overview_row(item: dict[str, Any], one: OneF1B | None, now: datetime) -> OverviewRow:
    """One table row from a `Repository.list_plans` item and the key's 1F1B figure (None: pending)."""
    makespan = float(item["makespan_ms"])
    limit = item.get("memory_limit_mib")
    if one is None:
        speedup, note, title = None, "…", "computing 1F1B on this problem"
    elif one.makespan_ms is None:
        speedup, note, title = None, one.note, one.detail or one.note
    else:
        speedup = views.speedup_over(one.makespan_ms, makespan)
        note = "" if one.detail in ("", "1F1B") else "interleaved"
        title = f"{one.detail or '1F1B'} makespan {views.fmt_ms(one.makespan_ms)} at the same memory limit"
    updated = _parse_time(item.get("updated_at"))
    n_dev = int(item["num_devices"])
    return OverviewRow(
        key=item["problem_key"],
        model=" · ".join(x for x in (item.get("model") or "", one.hardware if one else "") if x),
        devices=n_dev,
        microbatches=int(item["num_microbatches"]),
        chunks=int(item.get("stages_per_device") or item.get("num_stages", n_dev) // max(1, n_dev)),
        memory="no memory limit" if limit is None else f"limit {views.fmt_mib(limit)}",
        makespan=views.fmt_ms(makespan),
        bound=views.fmt_ms(item.get("lower_bound_ms")),
        gap=views.fmt_pct(item.get("gap")),
        bubble=views.fmt_pct(item.get("bubble_ratio")),
        speedup=speedup,
        speedup_note=note,
        speedup_title=title,
        revision=int(item["revision"]),
        job_state=item.get("job_state"),
        job_outcome=item.get("job_outcome"),
        job_outcome_text=item.get("job_outcome_words"),
        job_outcome_title=item.get("job_outcome_text"),
        status=item.get("status") or "",
        updated=views.fmt_age(updated, now),
        updated_iso=updated.isoformat() if updated else "",
        pending=one is None,
    )


def fill_one_f_one_b(cache: BaselineCache, keys: Iterable[str], load_problem: Callable[[str], Problem | None],
                     budget_s: float) -> dict[str, OneF1B]:
    """1F1B figures for `keys`: cached ones at once, missing ones computed until `budget_s` runs out.

    Keys left out stay "pending"; the page fetches their rows afterwards, so a first view of a page
    of never-seen configurations stays fast.
    """
    out: dict[str, OneF1B] = {}
    deadline = time.perf_counter() + budget_s
    for key in keys:
        found = cache.one_f_one_b.get(key)
        if found is None and time.perf_counter() < deadline:
            problem = load_problem(key)
            if problem is not None:
                found = cache.one_f_one_b_of(key, problem)
        if found is not None:
            out[key] = found
    return out


def page_links(page: int, pages: int, width: int = 2) -> list[int | None]:
    """1 … p-2 p-1 p p+1 p+2 … N (None marks a gap)."""
    wanted = {1, pages, *range(max(1, page - width), min(pages, page + width) + 1)}
    out: list[int | None] = []
    last = 0
    for p in sorted(wanted):
        if p - last > 1:
            out.append(None)
        out.append(p)
        last = p
    return out


# -- plan page -----------------------------------------------------------------------------------------

ZOOMS = (1, 2, 4, 8, 16, 32)


class RenderCache:
    """Rendered SVGs per (key, revision, zoom): a stored revision is immutable."""

    def __init__(self, size: int = 64, max_mib: float = 64.0):
        self._lru = _LRU(size, max_mib * 2**20, _chart_bytes)
        self._memories = _LRU(4)  # only to draw the same revision at another zoom

    def charts(self, key: str, problem: Problem, plan: Plan, zoom: int = 1) -> dict[str, Any]:
        zoom = zoom if zoom in ZOOMS else 1

        def compute():
            memories = self._memories.get_or_compute(
                (key, plan.revision), lambda: views.device_memories(problem, plan))
            width = views.CHART_W * zoom
            return {
                "gantt": views.gantt_svg(problem, plan, width),
                "gantt_labels": views.gantt_labels_svg(problem, plan),
                "memory": views.memory_svg(problem, plan, width, memories),
                "memory_labels": views.memory_labels_svg(problem, plan, memories),
                "legend": views.legend_items(plan),
                "ops": sum(len(dp.ops) for dp in plan.devices),
                "zoom": zoom,
            }
        return self._lru.get_or_compute((key, plan.revision, zoom), compute)


def _chart_bytes(charts: dict[str, Any]) -> float:
    return float(sum(len(charts[name]) for name in ("gantt", "gantt_labels", "memory", "memory_labels")))


def revision_points(revisions: list[dict[str, Any]]) -> list[views.RevisionPoint]:
    points = []
    for r in revisions:
        when = _parse_time(r.get("created_at")) or datetime.now(UTC)
        bound = max(r.get("lower_bound_ms") or 0.0, r.get("solver_bound_ms") or 0.0)
        points.append(views.RevisionPoint(int(r["revision"]), when, float(r["makespan_ms"]), bound,
                                          str(r.get("method") or "")))
    return points
