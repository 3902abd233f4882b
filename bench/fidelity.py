"""Predicted vs measured: classic schedules and our solved plan, run through torch's runtime.

Run:  .venv/bin/python bench/fidelity.py                 (about a minute and a half on 2 cores)
      .venv/bin/python bench/fidelity.py --iterations 5 --solve-s 20 --json

Every plan runs on 4 gloo ranks (CPU processes) in emulated time (client.emulated_pipeline): each
op's real work runs on a small MLP block, then a timed wait fills it up to the duration the problem
gives it (copies on their copy lanes), so the measured iteration time shows what the runtime adds to
or takes from the plan: waits on links, the runtime's own overhead between ops, lost overlap.

Problem: 4 devices, 8 microbatches, F/B/W = 20/24/16 ms per stage (a B heavier than W, as on real
models), copies 12 ms each way, 1-ms links (gloo on this machine measures about 0.3-1 ms), offload and
recompute allowed. 1F1B and ZB-H1 run without a memory limit; "ours" is the solver's plan under a
limit halfway between the least memory any schedule needs and 1F1B's peak, so it has to offload and
recompute; ZB-V runs on the V placement of the same model (8 half-cost chunks). Measured iteration =
median over the measured iterations (after one warm-up). Targets: measured within 5% of predicted;
measured speed-up over 1F1B at least 90% of the predicted one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.emulated_pipeline import Job, run_emulated  # noqa: E402
from planner.baselines import run_baseline  # noqa: E402
from planner.bounds import min_memory  # noqa: E402
from planner.contract import Plan, Problem  # noqa: E402
from planner.fidelity import fidelity  # noqa: E402

F_MS, B_MS, W_MS, COPY_MS, P2P_MS = 20.0, 24.0, 16.0, 12.0, 1.0


def problem(p: int = 4, m: int = 8, chunks: int = 1) -> Problem:
    stages = []
    for k in range(p * chunks):
        c, r = divmod(k, p)
        device = p - 1 - r if chunks == 2 and c % 2 else r
        stages.append({"device": device, "forward_ms": F_MS / chunks, "backward_input_ms": B_MS / chunks,
                       "backward_weight_ms": W_MS / chunks, "offload_ms": COPY_MS / chunks,
                       "activation_mib": 100.0 / chunks, "weight_grad_mib": 20.0 / chunks,
                       "checkpoint_mib": 5.0 / chunks})
    return Problem.model_validate({
        "num_devices": p, "num_microbatches": m, "p2p_ms": P2P_MS,
        "options": {"split_backward": True, "offload": True, "recompute": True},
        "stages": stages, "devices": [{"memory_limit_mib": None} for _ in range(p)]})


def limited(base: Problem, fraction: float) -> Problem:
    """`base` with limits `fraction` of the way from the least feasible memory to 1F1B's peak."""
    peak, floor = run_baseline(base, "1f1b").peak_memory_mib, min_memory(base)
    doc = base.model_dump(mode="json")
    for d, device in enumerate(doc["devices"]):
        device["memory_limit_mib"] = floor[d] + fraction * (peak[d] - floor[d])
    return Problem.model_validate(doc)


def solved(base: Problem, seconds: float) -> Plan:
    from planner.solver import solve

    return solve(base, seconds, workers=1, seed=0).plan


def kinds(plan: Plan) -> str:
    present = {p.kind for d in plan.devices for p in d.ops}
    return "+".join(k.lower() for k in ("OFFLOAD", "RECOMPUTE") if k in present) or "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--solve-s", type=float, default=10.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    loop, v = problem(), problem(chunks=2)
    tight = limited(loop, 0.5)
    rows: list[tuple[str, Problem, Plan]] = [("1F1B", loop, run_baseline(loop, "1f1b")),
                                             ("ZB-H1", loop, run_baseline(loop, "zb-h1")),
                                             ("ours (solved, memory-limited)", tight, solved(tight, args.solve_s))]
    v_rows = [("ZB-V", v, run_baseline(v, "zb-v"))]
    results = []
    for batch in (rows, v_rows):
        traces = run_emulated([Job(prob, plan) for _, prob, plan in batch], iterations=args.iterations, warmup=1)
        for (name, prob, plan), job in zip(batch, traces):
            measured = statistics.median(t.makespan_ms for t in job)
            worst = max(job, key=lambda t: abs(t.makespan_ms - plan.makespan_ms))
            report = fidelity(prob, plan, worst)
            results.append({"plan": name, "memory_actions": kinds(plan), "predicted_ms": plan.makespan_ms,
                            "measured_ms": measured, "error_pct": 100 * (measured / plan.makespan_ms - 1),
                            "runs_ms": [round(t.makespan_ms, 1) for t in job],
                            "overhead_on_path_ms": sum(s.gap_ms for s in report.critical_path)})
    base = results[0]
    for r in results:
        r["predicted_speedup"] = base["predicted_ms"] / r["predicted_ms"]
        r["measured_speedup"] = base["measured_ms"] / r["measured_ms"]
        r["speedup_ratio"] = (r["measured_speedup"] - 1) / (r["predicted_speedup"] - 1) \
            if r["predicted_speedup"] > 1.0001 else None
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"emulated time, 4 gloo ranks, M=8, F/B/W {F_MS:g}/{B_MS:g}/{W_MS:g} ms, copies {COPY_MS:g} ms,"
          f" links {P2P_MS:g} ms; {args.iterations} measured iterations each\n")
    print(f"{'plan':31} {'actions':17} {'predicted':>10} {'measured':>10} {'error':>7} "
          f"{'speed-up pred':>13} {'meas':>6} {'meas/pred':>9}")
    for r in results:
        ratio = f"{100 * r['speedup_ratio']:.0f}%" if r["speedup_ratio"] is not None else "-"
        print(f"{r['plan']:31} {r['memory_actions']:17} {r['predicted_ms']:8.1f}ms {r['measured_ms']:8.1f}ms"
              f" {r['error_pct']:+6.1f}% {r['predicted_speedup']:12.3f}x {r['measured_speedup']:5.3f}x {ratio:>9}")
    within = all(abs(r["error_pct"]) <= 5 for r in results)
    speedups = all(r["speedup_ratio"] is None or r["speedup_ratio"] >= 0.9 for r in results)
    print(f"\nevery plan within 5% of predicted: {'yes' if within else 'NO'};"
          f" measured speed-up >= 90% of predicted (of the gain over 1F1B): {'yes' if speedups else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
