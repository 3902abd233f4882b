"""Configuration searches in SQL (docs/configure.md): run one, store it with its candidates, and read
its ranking as the candidates' refine jobs improve their plans.

Each scored candidate is an ordinary cached problem (its own key, revisions, refine job); this module
stores only the link (tables `configurations`, `configuration_candidates`) and the search's document.
The best `configure_refine_top` candidates keep their queued refine job (one per candidate, on the
shared queue: N workers share one search); the other candidates' jobs are cancelled at once (their
first plan stands; POST /v1/plans/{key}/refine asks for more). A ranking is rebuilt only when a
candidate's best revision or job state changed, reading only the plans of revised candidates.
"""

from __future__ import annotations

import hashlib
import json
import threading
from typing import Any

from cachetools import LRUCache
from pipeplan.planner.configure import CONFIGURATIONS_FORMAT, ConfigureError, configure, fast_plan
from pipeplan.planner.configure_space import ConfigureRequest
from pipeplan.planner.contract import Limits, error_messages
from pydantic import ValidationError
from sqlalchemy import select

from .db import make_engine
from .models import ConfigurationCandidateRow, ConfigurationRow, JobRow, ProblemRow, utcnow
from .repository import Repository


def configuration_key(spec: dict[str, Any], request: dict[str, Any]) -> str:
    """The same spec and request (canonical JSON) are the same search."""
    body = json.dumps({"spec": spec, "request": request}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"{CONFIGURATIONS_FORMAT}:{body}".encode()).hexdigest()


class ConfigurationStore:
    @classmethod
    def of(cls, repo: Repository) -> ConfigurationStore:
        """The repository's one store, so its ranking cache outlives a request."""
        return repo.attached(cls)

    def __init__(self, repo: Repository, cached: int = 256):
        self.repo = repo
        self._cache: LRUCache = LRUCache(maxsize=cached)  # key -> (revision set, document)
        self._lock = threading.Lock()

    def create(self, key: str, document: dict[str, Any], candidates: list[tuple[str, bool]]) -> bool:
        """Insert the search and its candidates unless it exists (concurrent creators: one wins)."""
        with self.repo.engine.begin() as conn:
            res = conn.execute(self.repo._insert_ignore(ConfigurationRow).values(
                key=key, document=document, created_at=utcnow()).returning(ConfigurationRow.key))
            if res.scalar() is None:
                return False
            conn.execute(ConfigurationCandidateRow.__table__.insert(), [
                {"configuration_key": key, "idx": i, "candidate_key": k, "refined": r}
                for i, (k, r) in enumerate(candidates)])
        return True

    def exists(self, key: str) -> bool:
        with self.repo.engine.connect() as conn:
            return conn.execute(select(ConfigurationRow.key).where(ConfigurationRow.key == key)).first() is not None

    def candidate_keys(self, key: str) -> set[str]:
        with self.repo.engine.connect() as conn:
            return set(conn.execute(select(ConfigurationCandidateRow.candidate_key)
                                    .where(ConfigurationCandidateRow.configuration_key == key)).scalars())

    def _states(self, key: str) -> list[tuple]:
        """Each candidate's (key, best revision, job state, refined): what a ranking depends on."""
        with self.repo.engine.connect() as conn:
            q = (select(ConfigurationCandidateRow.candidate_key, ProblemRow.best_revision, JobRow.state,
                        ConfigurationCandidateRow.refined)
                 .join(ProblemRow, ProblemRow.key == ConfigurationCandidateRow.candidate_key)
                 .outerjoin(JobRow, JobRow.key == ProblemRow.key)
                 .where(ConfigurationCandidateRow.configuration_key == key)
                 .order_by(ConfigurationCandidateRow.idx))
            return [tuple(r) for r in conn.execute(q)]

    def ranking(self, key: str) -> dict[str, Any] | None:
        """The configurations document with each candidate's best stored plan now, ranked again
        (shared: do not modify)."""
        states = tuple(self._states(key))
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None and hit[0] == states:
            return hit[1]
        with self.repo.engine.connect() as conn:
            doc = conn.execute(select(ConfigurationRow.document).where(ConfigurationRow.key == key)).scalar()
        if doc is None:
            return None
        doc = live_document(doc, {s[0]: s for s in states}, self.repo)
        with self._lock:
            self._cache[key] = (states, doc)
        return doc


def live_document(doc: dict[str, Any], states: dict[str, tuple], repo: Repository) -> dict[str, Any]:
    """`doc` with the figures of every candidate whose best plan is past revision 1 read from that plan,
    the candidates and the scored list ranked again (tokens/s per GPU, then peak memory, then the
    search's order), and each entry's revision and job state."""
    doc = json.loads(json.dumps(doc))
    plans: dict[str, Any] = {}
    for entry in doc["candidates"] + doc["scored"]:
        k = entry["problem_key"]
        state = states.get(k)
        if state is None:
            continue
        entry["revision"], entry["job_state"], entry["refined"] = state[1], state[2], state[3]
        if state[1] > 1:
            if k not in plans:
                plans[k] = repo.best_plan(k)
            plan = plans[k]
            if plan is not None and plan.tokens_per_s_per_gpu:
                entry.update(tokens_per_s_per_gpu=round(plan.tokens_per_s_per_gpu, 2),
                             iteration_ms=round(plan.end_ms, 3),
                             peak_memory_mib=round(max(plan.peak_memory_mib), 1))
                if "makespan_ms" in entry:
                    entry.update(makespan_ms=round(plan.makespan_ms, 3), method=plan.method,
                                 mfu=round(plan.mfu or 0.0, 4), bubble_ratio=round(plan.bubble_ratio, 4))
    for name in ("candidates", "scored"):
        order = {e["problem_key"]: i for i, e in enumerate(doc[name])}
        doc[name].sort(key=lambda e: (-e["tokens_per_s_per_gpu"], e["peak_memory_mib"], order[e["problem_key"]]))
        for i, e in enumerate(doc[name]):
            e["rank"] = i + 1
    return doc


# -- a new search (in the API's killable child: service.inline.run_in_child) ----------------------------
def run_search(job: dict[str, Any]) -> dict[str, Any]:
    """Search, store every scored candidate's first plan (ordinary problems), keep the refine jobs of
    the best `refine_top`, cancel the others', store the search. Returns {"key", "created", "new":
    keys whose refine job the API enqueues} or {"error": {...}} (422 naming the field)."""
    from pipeplan.planner.spec import check_spec_size, spec_from_document

    key = job["key"]
    try:
        limits = Limits(**job["limits"])
        check_spec_size(job["spec"], limits)
        spec = spec_from_document(job["spec"])
        request = ConfigureRequest.model_validate(job["request"])
        result = configure(spec, request, plan_fn=lambda p, k: fast_plan(p, k, validate=False), limits=limits,
                           max_scheduled=job["max_scheduled"])
    except ConfigureError as exc:
        return {"error": {"status": 422, "code": "invalid_request", "message": str(exc),
                          "extra": {"field": exc.field, **exc.hint}}}
    except (ValidationError, ValueError) as exc:
        return {"error": {"status": 422, "code": "invalid_request", "message": "; ".join(
            f"spec.{m}" for m in error_messages(exc)), "extra": {}}}
    engine = make_engine(job["database_url"], 1)
    try:
        repo = Repository(engine)
        store = ConfigurationStore(repo)
        if store.exists(key):
            return {"key": key, "created": False, "new": []}
        refine = {c.key for c in result.ranked[:job["refine_top"]]}
        new, links = [], []
        for c in result.scheduled:
            _, created, _ = repo.store_first(c.problem, c.plan, job["budget_s"], key=c.key, owner=job.get("owner"))
            if created and c.key in refine:
                new.append(c.key)
            elif created:
                repo.request_cancel(c.key)  # its first plan stands; a refine can be asked for later
            links.append((c.key, c.key in refine))
        created = store.create(key, result.to_document(), links)
    finally:
        engine.dispose()
    return {"key": key, "created": created, "new": new}
