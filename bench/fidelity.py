"""Predicted vs measured: classic schedules and our solved plan, run through torch's runtime.

Run:  .venv/bin/python bench/fidelity.py                 (one to two minutes on 2 cores)
      .venv/bin/python bench/fidelity.py --iterations 5 --calibrate 2 --solve-s 20 --json
      python bench/fidelity.py --cuda [--device cpu --width 256 ...]   (one stage on a GPU against its
                                                 prediction: bench/fidelity_cuda.py, its own options)

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

Two predictions per plan:
- nominal: the plan's own makespan, on the problem as written (the durations the ops are padded to,
  1-ms links). The runtime's own time between ops (~0.15-0.3 ms here: torch's dispatch, issuing the
  sends, our hooks) is not in it, and gloo's real link time (~0.2-0.4 ms) is below the 1 ms assumed.
- calibrated: what a user gets from the calibration loop (`pipeplan fidelity ... --calibrated`, or
  posting a trace to the service): the first `--calibrate` iterations of every plan on a placement are
  traced, `planner.fidelity.calibrated_problem` turns them into measured per-op costs (the runtime's
  overhead per op included) and link time, and the same plan's orders are timed under that problem
  (`planner.fidelity.retime`). It is a prediction of the later iterations, which are the measured
  ones; no iteration is both calibration and measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeplan.client.emulated_pipeline import Job, run_emulated
from pipeplan.planner.baselines import run_baseline
from pipeplan.planner.bounds import min_memory
from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.fidelity import calibrated_problem, fidelity, retime

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
    from pipeplan.planner.solver import solve

    return solve(base, seconds, workers=1, seed=0).plan


def kinds(plan: Plan) -> str:
    present = {p.kind for d in plan.devices for p in d.ops}
    return "+".join(k.lower() for k in ("OFFLOAD", "RECOMPUTE") if k in present) or "-"


def main() -> int:
    if "--cuda" in sys.argv[1:]:  # one stage on a GPU against its prediction: bench/fidelity_cuda.py
        from fidelity_cuda import main as cuda_main

        return cuda_main([a for a in sys.argv[1:] if a != "--cuda"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3, help="measured iterations per plan")
    parser.add_argument("--calibrate", type=int, default=1,
                        help="iterations per plan (before the measured ones) the calibrated prediction is made from")
    parser.add_argument("--solve-s", type=float, default=10.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--markdown", action="store_true", help="the table as the README quotes it")
    args = parser.parse_args()

    loop, v = problem(), problem(chunks=2)
    tight = limited(loop, 0.5)
    rows: list[tuple[str, Problem, Plan]] = [("1F1B", loop, run_baseline(loop, "1f1b")),
                                             ("ZB-H1", loop, run_baseline(loop, "zb-h1")),
                                             ("ours (solved, memory-limited)", tight, solved(tight, args.solve_s))]
    v_rows = [("ZB-V", v, run_baseline(v, "zb-v"))]
    results = []
    for batch in (rows, v_rows):
        traces = run_emulated([Job(prob, plan) for _, prob, plan in batch],
                              iterations=args.calibrate + args.iterations, warmup=1)
        calibration = [t for job in traces for t in job[:args.calibrate]]
        for (name, prob, plan), job in zip(batch, traces):
            measured_runs = job[args.calibrate:]
            measured = statistics.median(t.makespan_ms for t in measured_runs)
            worst = max(measured_runs, key=lambda t: abs(t.makespan_ms - plan.makespan_ms))
            report = fidelity(prob, plan, worst)
            calibrated = calibrated_problem(prob, calibration)
            cal_ms = retime(calibrated, plan)
            results.append({"plan": name, "memory_actions": kinds(plan), "predicted_ms": plan.makespan_ms,
                            "measured_ms": measured, "error_pct": 100 * (measured / plan.makespan_ms - 1),
                            "calibrated_ms": cal_ms, "calibrated_error_pct": 100 * (measured / cal_ms - 1),
                            "calibration": {"p2p_ms": calibrated.p2p_ms, "runtime_overhead_ms":
                                            calibrated.metadata["calibrated_from"]["runtime_overhead_ms"]},
                            "runs_ms": [round(t.makespan_ms, 1) for t in measured_runs],
                            "overhead_on_path_ms": sum(s.gap_ms for s in report.critical_path)})
    base = results[0]
    for r in results:
        for which in ("predicted", "calibrated"):
            r[f"{which}_speedup"] = base[f"{which}_ms"] / r[f"{which}_ms"]
        r["measured_speedup"] = base["measured_ms"] / r["measured_ms"]
        for which in ("predicted", "calibrated"):  # share of the predicted gain over 1F1B that was measured
            gain = r[f"{which}_speedup"] - 1
            r[f"{which}_gain_measured"] = (r["measured_speedup"] - 1) / gain if gain > 0.0001 else None
        r["speedup_ratio"] = r["predicted_gain_measured"]
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    if args.markdown:
        print(markdown(results))
        return 0
    print(f"emulated time, 4 gloo ranks, M=8, F/B/W {F_MS:g}/{B_MS:g}/{W_MS:g} ms, copies {COPY_MS:g} ms,"
          f" links {P2P_MS:g} ms; calibrated from {args.calibrate} iteration(s), then {args.iterations}"
          " measured iterations each\n")
    print(f"{'plan':31} {'actions':17} {'nominal':>9} {'calibr.':>9} {'measured':>9} {'err nom':>7} {'err cal':>7}"
          f" {'speed-up nom':>12} {'cal':>6} {'meas':>6} {'gain nom':>8} {'gain cal':>8}")
    for r in results:
        gains = [f"{100 * r[f'{w}_gain_measured']:.0f}%" if r[f"{w}_gain_measured"] is not None else "-"
                 for w in ("predicted", "calibrated")]
        print(f"{r['plan']:31} {r['memory_actions']:17} {r['predicted_ms']:7.1f}ms {r['calibrated_ms']:7.1f}ms"
              f" {r['measured_ms']:7.1f}ms {r['error_pct']:+6.1f}% {r['calibrated_error_pct']:+6.1f}%"
              f" {r['predicted_speedup']:11.3f}x {r['calibrated_speedup']:5.3f}x {r['measured_speedup']:5.3f}x"
              f" {gains[0]:>8} {gains[1]:>8}")
    cal = results[0]["calibration"]
    print(f"\ncalibrated (loop placement): link {cal['p2p_ms']:.2f} ms, runtime overhead"
          f" {cal['runtime_overhead_ms']:.2f} ms per compute op")
    for which, label in (("error_pct", "nominal"), ("calibrated_error_pct", "calibrated")):
        gain = "predicted_gain_measured" if label == "nominal" else "calibrated_gain_measured"
        within = all(abs(r[which]) <= 5 for r in results)
        speedups = all(r[gain] is None or r[gain] >= 0.9 for r in results)
        print(f"{label}: every plan within 5% of predicted: {'yes' if within else 'NO'};"
              f" measured gain over 1F1B >= 90% of the predicted gain: {'yes' if speedups else 'NO'}")
    return 0


def markdown(results: list[dict]) -> str:
    def gain(r: dict, which: str) -> str:
        share = r[f"{which}_gain_measured"]
        return "" if share is None else f" ({100 * share:.0f}% of the gain)"

    header = ("| plan | memory actions | predicted: nominal | calibrated | measured | error vs nominal"
              " | vs calibrated | speed-up over 1F1B: nominal | calibrated | measured |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['plan']} | {r['memory_actions'].replace('+', ' + ')} | {r['predicted_ms']:.1f} ms"
                     f" | {r['calibrated_ms']:.1f} ms | {r['measured_ms']:.1f} ms | {r['error_pct']:+.1f}%"
                     f" | {r['calibrated_error_pct']:+.1f}% | {r['predicted_speedup']:.3f}x{gain(r, 'predicted')}"
                     f" | {r['calibrated_speedup']:.3f}x{gain(r, 'calibrated')} | {r['measured_speedup']:.3f}x |")
    cal = results[0]["calibration"]
    lines.append(f"\nCalibrated (loop placement): link {cal['p2p_ms']:.2f} ms, runtime overhead"
                 f" {cal['runtime_overhead_ms']:.2f} ms per compute op.")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
