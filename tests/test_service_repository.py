"""The SQL cache on real SQLite and real PostgreSQL: first revision and job dedup, the atomic
"replace if better" upsert under concurrent writers, validation before storing, job transitions."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from pipeplan.planner.validator import InvalidPlanError
from pipeplan.service.models import CANCELLED, DONE, QUEUED, SOLVING, JobRow, RevisionRow
from pipeplan.service.repository import Repository
from service_support import any_db_url, gpipe_plan, make_problem, migrated_engine, wait_for  # noqa: F401
from sqlalchemy import func, select


@pytest.fixture
def repo(any_db_url):  # noqa: F811
    engine = migrated_engine(any_db_url)
    yield Repository(engine)
    engine.dispose()


def test_concurrent_first_store_creates_one_revision_and_one_job(repo):
    problem = make_problem()
    key = problem.key()
    plan = gpipe_plan(problem)
    barrier = threading.Barrier(12)

    def store(_):
        barrier.wait()
        return repo.store_first(problem, plan, budget_s=5.0, key=key)

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(store, range(12)))
    assert sum(created for _, created, _ in results) == 1
    assert {rev for rev, _, _ in results} == {1}
    assert len({job.run_id for _, _, job in results}) == 1
    with repo.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(RevisionRow)).scalar() == 1
        assert conn.execute(select(func.count()).select_from(JobRow)).scalar() == 1
    best = repo.best(key)
    assert best.revision == 1 and '"revision":1' in best.plan_json
    assert repo.job(key).state == QUEUED


def test_concurrent_writers_keep_only_improvements(repo):
    problem = make_problem(tag="upsert")
    key = problem.key()
    base = gpipe_plan(problem, delay_ms=50.0)
    repo.store_first(problem, base, budget_s=5.0, key=key)
    delays = [45.0, 40.0, 40.0, 30.0, 49.0, 20.0, 35.0, 10.0, 10.0, 25.0, 5.0, 60.0]
    plans = [gpipe_plan(problem, delay_ms=d) for d in delays]
    barrier = threading.Barrier(len(plans))

    def store(plan):
        barrier.wait()
        return repo.store_if_better(key, plan, problem)

    with ThreadPoolExecutor(len(plans)) as pool:
        stored = [r for r in pool.map(store, plans) if r is not None]
    revisions = repo.revisions(key)
    makespans = [r["makespan_ms"] for r in revisions]
    assert [r["revision"] for r in revisions] == list(range(1, len(revisions) + 1))
    assert sorted(stored) == list(range(2, len(revisions) + 1))
    assert all(b < a for a, b in zip(makespans, makespans[1:])), makespans  # strictly better each time
    assert repo.best(key).makespan_ms == pytest.approx(min(p.makespan_ms for p in plans))
    # equal or worse: refused; the same makespan proven optimal: accepted
    assert repo.store_if_better(key, gpipe_plan(problem, delay_ms=5.0), problem) is None
    proven = gpipe_plan(problem, delay_ms=5.0).model_copy(update={"status": "optimal"})
    assert repo.store_if_better(key, proven, problem) == len(revisions) + 1
    assert repo.best(key).status == "optimal"
    assert repo.job(key).improvements == len(revisions) - 1  # a proof is a revision, not an improvement
    assert repo.improvements_total() == len(revisions) - 1


def test_invalid_plan_is_never_stored(repo):
    problem = make_problem(tag="invalid")
    key = problem.key()
    repo.store_first(problem, gpipe_plan(problem, delay_ms=10), 5.0, key=key)
    plan = gpipe_plan(problem)
    broken = plan.model_copy(deep=True)
    broken.devices[0].ops[0].end_ms += 0.5  # wrong duration
    broken.makespan_ms = 0.1  # and a too-good-to-be-true makespan
    with pytest.raises(InvalidPlanError):
        repo.store_if_better(key, broken, problem)
    assert repo.best(key).revision == 1


def test_job_lifecycle_claim_heartbeat_cancel_requeue(repo):
    problem = make_problem(tag="jobs")
    key = problem.key()
    _, _, job = repo.store_first(problem, gpipe_plan(problem, delay_ms=10), 5.0, key=key)
    assert repo.claim(key, "someone-else", "w") is None
    claimed = repo.claim(key, job.run_id, "w1")
    assert claimed.state == SOLVING and claimed.attempts == 1
    assert repo.claim(key, job.run_id, "w2") is None  # one owner
    assert repo.heartbeat(key, job.run_id, 1.5) is False
    # refine while solving queues nothing
    _, queued = repo.request_refine(key, 9.0)
    assert not queued
    assert repo.request_cancel(key).cancel_requested
    assert repo.heartbeat(key, job.run_id, 2.0) is True
    assert repo.finish(key, job.run_id, CANCELLED)
    assert repo.job(key).state == CANCELLED
    again, queued = repo.request_refine(key, 9.0)
    assert queued and again.state == QUEUED and again.run_id != job.run_id and again.budget_s == 9.0
    # a stale solving run is re-queued exactly once, and the old run loses ownership
    repo.claim(key, again.run_id, "w3")
    stale = repo.job(key)
    new_run = repo.requeue(stale)
    assert new_run and repo.requeue(stale) is None
    assert repo.heartbeat(key, again.run_id, 3.0) is None
    assert not repo.finish(key, again.run_id, DONE)
    assert repo.job(key).state == QUEUED and repo.job(key).run_id == new_run


def test_listing_has_summary_fields_and_pages(repo):
    keys = []
    for i in range(5):
        p = make_problem(microbatches=2 + i, tag="list")
        repo.store_first(p, gpipe_plan(p), 5.0)
        keys.append(p.key())
    items, total = repo.list_plans(offset=0, limit=2, sort="num_microbatches", descending=False)
    assert total >= 5 and len(items) == 2
    assert items[0]["num_microbatches"] <= items[1]["num_microbatches"]
    first = items[0]
    for field in ("problem_key", "model", "num_devices", "stages_per_device", "memory_limit_mib", "makespan_ms",
                  "lower_bound_ms", "gap", "bubble_ratio", "revision", "job_state", "updated_at"):
        assert field in first
    assert first["model"] == "tiny-test" and first["job_state"] == QUEUED
    page2, _ = repo.list_plans(offset=2, limit=2, sort="num_microbatches", descending=False)
    assert not {i["problem_key"] for i in page2} & {i["problem_key"] for i in items}
    found, n = repo.list_plans(q=keys[3][:10])
    assert n == 1 and found[0]["problem_key"] == keys[3]
    assert repo.job_counts()[QUEUED] >= 5


def test_reconciler_requeues_orphans_and_gives_up_on_job_killers(repo):
    """The reconciler against a real (in-process) queue: stale runs are re-enqueued once; a run whose
    workers keep dying is failed after max_attempts instead of looping forever."""
    from pipeplan.service.queue import LocalQueue
    from pipeplan.service.reconcile import reconcile

    enqueued: list[str] = []
    queue = LocalQueue(lambda key, run_id: enqueued.append(run_id), workers=1)  # runs only record
    problem = make_problem(tag="reconcile")
    key = problem.key()
    _, _, job = repo.store_first(problem, gpipe_plan(problem, delay_ms=5), 5.0, key=key)
    assert reconcile(repo, queue, stale_after_s=60, queued_grace_s=0) == 1  # queued but unknown to the queue
    run = repo.job(key).run_id
    wait_for(lambda: enqueued == [run], 5, what="the re-enqueued run")
    assert run != job.run_id
    assert reconcile(repo, queue, stale_after_s=60, queued_grace_s=3600) == 0
    for attempt in range(1, 4):
        assert repo.claim(key, repo.job(key).run_id, f"w{attempt}")
        n = reconcile(repo, queue, stale_after_s=0, queued_grace_s=3600, max_attempts=3)
        assert n == (1 if attempt < 3 else 0)
    final = repo.job(key)
    assert final.state == "failed" and "3 attempts" in final.error
    queue.close()


def test_finish_records_how_the_run_ended_and_a_new_run_forgets_it(repo):
    """"done" always comes with its outcome, gap and searched seconds (one UPDATE); the listing and the
    job say it in words; the next refine run starts without the previous verdict."""
    problem = make_problem(tag="outcome")
    key = problem.key()
    _, _, job = repo.store_first(problem, gpipe_plan(problem, delay_ms=10), 5.0, key=key)
    repo.claim(key, job.run_id, "w1")
    assert repo.finish(key, job.run_id, DONE, outcome="budget", gap_pct=4.13, searched_s=5.02, run_improvements=2)
    done = repo.job(key)
    assert (done.state, done.outcome, done.gap_pct, done.searched_s, done.run_improvements) == (
        DONE, "budget", 4.13, 5.02, 2)
    assert done.outcome_text == "budget spent after 5.0 s, gap 4.1% to the proven bound"
    assert done.to_dict()["outcome_text"] == done.outcome_text
    item = next(i for i in repo.list_plans(q=key[:16])[0] if i["problem_key"] == key)
    assert item["job_state"] == DONE and item["job_outcome"] == "budget"
    assert item["job_outcome_text"] == done.outcome_text
    again, queued = repo.request_refine(key, 3.0)
    assert queued and again.outcome is None and again.gap_pct is None and again.outcome_text is None


def test_a_first_plan_at_its_proven_bound_is_done_optimal_without_a_run(repo):
    problem = make_problem(tag="proven")
    plan = gpipe_plan(problem).model_copy(update={"status": "optimal"})
    _, created, job = repo.store_first(problem, plan, 5.0)
    assert created and job.state == DONE and job.outcome == "optimal" and job.gap_pct == 0.0
    assert job.outcome_text == "optimal (proven)" and job.finished_at is not None


def test_the_same_makespan_with_a_shorter_iteration_is_the_next_revision(repo):
    """The solvers' second criterion reaches the cache: stages 2 and 3 of a 2-device loop reduce for
    6 ms; the greedy plan and CP-SAT's share the 19-ms makespan, CP-SAT's iteration is 4 ms shorter.
    It becomes revision 2 (not an improvement: the makespan is the same); the greedy plan again, or
    a plan of a longer iteration, is refused."""
    import uuid

    from pipeplan.planner.baselines import run_baseline
    from pipeplan.planner.contract import Device, Problem, Stage
    from pipeplan.planner.solver import solve

    stages = [Stage(device=k % 2, forward_ms=1, backward_input_ms=1, backward_weight_ms=1, activation_mib=1,
                    reduce_ms=[1.0, 1.0, 6.0, 6.0][k]) for k in range(4)]
    problem = Problem(num_devices=2, num_microbatches=3, stages=stages, metadata={"test": uuid.uuid4().hex},
                      devices=[Device(optimizer_ms=0.5), Device(optimizer_ms=0.5)])
    key = problem.key()
    seed = run_baseline(problem, "greedy", key)
    hidden = solve(problem, 20, engine="cpsat", workers=1, deterministic=True, problem_key=key).plan
    assert seed.makespan_ms == hidden.makespan_ms and hidden.iteration_ms < seed.iteration_ms - 1.0
    repo.store_first(problem, seed, budget_s=5.0, key=key)
    assert repo.store_if_better(key, hidden.model_copy(update={"status": "feasible"}), problem) == 2
    assert repo.store_if_better(key, seed, problem) is None
    best = repo.best(key)
    assert best.revision == 2 and best.makespan_ms == hidden.makespan_ms
    assert repo.job(key).improvements == 0
