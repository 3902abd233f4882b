"""Published H100 training runs against the cost model: measured tokens/s per GPU, predicted, error,
predicted peak memory per GPU against the HBM, and the best plan pipeplan's fast heuristics find for
the same configuration.

    .venv/bin/python bench/published.py                 # the table (about a minute)
    .venv/bin/python bench/published.py --only titan    # rows whose id contains "titan"
    .venv/bin/python bench/published.py --compact       # fewer columns, no pipeplan plan (seconds)
    .venv/bin/python bench/published.py --fit           # refit the calibrated figures (minutes)

Each run (bench/published_runs.py) becomes a spec with its own layout, precision, batch and framework
settings; its pipeline is scheduled by the schedule it ran (Megatron's interleaved 1F1B when VP > 1,
else 1F1B) and timed by the simulator, gradient reduction and optimizer step included; the plan's
tokens_per_s_per_gpu is the prediction. The peak is the plan's largest device peak with no memory
limit. "pipeplan" is the best of the fast heuristics (planner.baselines.best_heuristic; no CP-SAT:
these pipelines have up to 33k ops) on the same problem limited to the HBM, B and W split allowed.

Calibration (docs/costmodel.md): five figures, each fitted on the one run named in the table's
"role" column so that the prediction meets the measurement; every other row is a check. The fitted
values live in planner/spec.py (H100_EFFICIENCY, CLUSTER_EFFICIENCY, H100_HOST) and
bench/published_runs.py (GRAND_TETON); --fit recomputes them from the presets' starting point and
prints them. "gap" is a plan's pipeline makespan against the proven lower bound (planner.bounds), for
the run's schedule and for pipeplan's.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeplan.planner.baselines import best_heuristic, run_baseline
from pipeplan.planner.bounds import MemoryInfeasibleError
from pipeplan.planner.contract import Plan
from pipeplan.planner.documents import problem_from_document
from pipeplan.planner.spec import CLUSTERS, HARDWARE, Spec

from bench.published_runs import FIGURES, GRAND_TETON, RUNS, SCHEDULE_PAIR, SOURCES, Run

GIB = 1024.0


@dataclass
class Prediction:
    run: Run
    tokens: float
    peak_gib: float
    hbm_gib: float
    iteration_ms: float
    pipeline_ms: float
    gap: float  # the run's schedule: its pipeline's distance to the proven lower bound
    best: Plan | None = None
    best_note: str = ""
    seconds: float = 0.0

    @property
    def error(self) -> float:
        """Signed relative error of the predicted tokens/s against the measurement."""
        return self.tokens / self.run.measured - 1.0

    @property
    def fits(self) -> bool:
        return self.peak_gib <= self.hbm_gib

    @property
    def memory(self) -> str:
        """The table's peak-against-HBM cell."""
        return f"{self.peak_gib:.0f} / {self.hbm_gib:.0f}" + ("" if self.fits else " **over**")


def predict(run: Run, hardware: dict[str, Any] | None = None, cluster: dict[str, Any] | None = None,
            best: bool = False) -> Prediction:
    """The run's schedule on its pipeline, timed; with `best`, also pipeplan's best fast heuristic."""
    start = time.monotonic()
    doc = run.spec(hardware, cluster)
    problem = problem_from_document(doc)
    plan = run_baseline(problem, run.schedule)
    hbm = Spec.model_validate(doc).hardware.hbm_gib
    out = Prediction(run, plan.tokens_per_s_per_gpu, max(plan.peak_memory_mib) / GIB, hbm,
                     plan.iteration_ms, plan.makespan_ms, plan.gap)
    if best:
        doc["training"]["memory_budget_gib"] = None  # the GPU's HBM
        limited = problem_from_document(doc)
        try:
            out.best = best_heuristic(limited)
            out.best_note = re.match(r"[^ (]+(\([^)]*\))?", out.best.method).group(0)
        except MemoryInfeasibleError as exc:
            out.best_note = f"does not fit: {str(exc)[:60]}"
    out.seconds = time.monotonic() - start
    return out


# --------------------------------------------------------------------------------------------------
# Calibration
# --------------------------------------------------------------------------------------------------
def _solve(measure, target: float, lo: float, hi: float, increasing: bool = True) -> float:
    """x in [lo, hi] with measure(x) = target (measure monotonic in x), by bisection on a log scale."""
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        if (measure(mid) < target) == increasing:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1.0005:
            break
    return math.sqrt(lo * hi)


def figures() -> dict[str, float]:
    """The calibrated figures as the presets hold them now."""
    h100, dgx = HARDWARE["H100-80GB"], CLUSTERS["DGX-H100"]
    return {"matmul_efficiency": h100.fp8_efficiency, "bus_efficiency": dgx.bus_efficiency, **GRAND_TETON,
            "moe_host_ms": h100.moe_host_ms}


def predict_with(run: Run, fig: dict[str, float]) -> Prediction:
    """`predict` with every calibrated figure taken from `fig` instead of the presets."""
    hw = {"fp8_efficiency": fig["matmul_efficiency"], "bf16_efficiency": fig["matmul_efficiency"],
          "moe_host_ms": fig["moe_host_ms"]}
    if isinstance(run.hardware, dict):  # torchtitan's H100
        hw |= {"peak_tflops": 989 * fig["clock"], "fp8_tflops": 1979 * fig["clock"],
               "attention_efficiency": fig["attention_efficiency"]}
    return predict(run, hw, {"bus_efficiency": fig["bus_efficiency"]})


# Each figure's search range, and whether the prediction rises with it (a host floor slows it).
RANGES = {"moe_host_ms": (0.01, 100.0, False)}


def fit(rounds: int = 3) -> dict[str, float]:
    """Fit each figure (FIGURES) on its run so that the prediction meets the measurement, in turn,
    a few rounds since they interact a little (FP8 runs keep attention in 16 bits, MoE runs depend
    on the links, the host and the matmul rate together)."""
    fig = figures()
    for r in range(rounds):
        for name in FIGURES:
            run = next(x for x in RUNS if x.calibrates == name)
            lo, hi, increasing = RANGES.get(name, (0.02, 1.0, True))
            fig[name] = _solve(lambda v, run=run, name=name: predict_with(run, {**fig, name: v}).tokens,
                               run.measured, lo, hi, increasing)
            print(f"round {r + 1}: {name} = {fig[name]:.4f} (on {run.id})", file=sys.stderr)
    return fig


# --------------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------------
def row(p: Prediction) -> str:
    r = p.run
    if p.best is not None and p.best.tokens_per_s_per_gpu:
        gain = p.best.tokens_per_s_per_gpu / p.tokens - 1
        best = f"{p.best_note}: {p.best.tokens_per_s_per_gpu:,.0f} ({gain:+.1%}, gap {p.best.gap:.1%})"
    else:
        best = p.best_note or "-"
    sched = ("interleaved" if r.vp > 1 else "1F1B") + f" (gap {p.gap:.1%})"
    return (f"| {r.id} | {r.model['name']}, {r.gpus}x H100, {r.precision.upper()}, {r.layout}, "
            f"MBS {r.mbs}, GBS {r.gbs}, seq {r.seq} | {r.measured:,.0f} | {p.tokens:,.0f} | {p.error:+.1%} | "
            f"{p.memory} | {sched} | {best} | {r.role} | {r.source}: {r.where} |")


def summary(preds: list[Prediction]) -> list[str]:
    left_out = [p for p in preds if p.run.left_out]
    preds = [p for p in preds if not p.run.left_out]
    checks = [p for p in preds if not p.run.calibrates]
    lines = []
    if checks:
        errs = [abs(p.error) for p in checks]
        worst = max(checks, key=lambda p: abs(p.error))
        lines.append(f"Checks (rows not used for calibration): {len(checks)}; median |error| "
                     f"{statistics.median(errs):.2%}; largest {abs(worst.error):.1%} ({worst.run.id}); within"
                     f" 25%: {sum(e <= 0.25 for e in errs)} of {len(errs)}.")
    by_family: dict[str, list[float]] = {}
    for p in checks:
        by_family.setdefault(p.run.family, []).append(abs(p.error))
    lines.append("By family (checks): " + "; ".join(
        f"{fam} median {statistics.median(v):.1%} over {len(v)}" for fam, v in sorted(by_family.items())))
    over = [p.run.id for p in preds if not p.fits]
    lines.append("Every configuration fits its GPUs under the memory model." if not over
                 else f"Over the HBM under the memory model: {', '.join(over)}.")
    ids = {p.run.id: p for p in preds}
    if all(i in ids for i in SCHEDULE_PAIR):
        a, b = (ids[i] for i in SCHEDULE_PAIR)
        measured, predicted = b.run.measured / a.run.measured, b.tokens / a.tokens
        lines.append(f"Schedule pair ({a.run.id} vs {b.run.id}): measured interleaved/1F1B"
                     f" {measured:.2f}, predicted {predicted:.2f} ({(predicted - measured) * 100:+.0f} points).")
    lines += [f"Left out of the summary: {p.run.id}, {p.error:+.1%} as its table reads; {p.run.left_out}."
              for p in left_out]
    return lines


HEADER = ("| run | configuration | measured tok/s/GPU | predicted | error | peak GiB / HBM | schedule run (gap) |"
          " pipeplan best (fast heuristics): tok/s/GPU | role | source |\n"
          "|---|---|---:|---:|---:|---:|---|---|---|---|")
COMPACT = ("| run | measured tok/s/GPU | predicted | error | peak GiB / HBM | role |\n"
           "|---|---:|---:|---:|---:|---|")


def compact_row(p: Prediction) -> str:
    return (f"| {p.run.id} | {p.run.measured:,.0f} | {p.tokens:,.0f} | {p.error:+.1%} | {p.memory} |"
            f" {p.run.role} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="rows whose id contains this")
    ap.add_argument("--fit", action="store_true", help="refit the calibrated figures and print them")
    ap.add_argument("--no-best", action="store_true", help="skip pipeplan's own plan (faster)")
    ap.add_argument("--compact", action="store_true", help="fewer columns, no pipeplan plan (the README's)")
    args = ap.parse_args(argv)
    if args.fit:
        fig = fit()
        print("fitted: " + ", ".join(f"{k} = {v:.3f}" for k, v in fig.items()))
        return 0
    runs = [r for r in RUNS if not args.only or args.only in r.id]
    if not runs:
        print(f"--only {args.only}: no run matches; runs: {', '.join(r.id for r in RUNS)}", file=sys.stderr)
        return 2
    print(COMPACT if args.compact else HEADER)
    preds = []
    for run in runs:
        p = predict(run, best=not (args.no_best or args.compact))
        preds.append(p)
        print(compact_row(p) if args.compact else row(p), flush=True)
    print()
    for line in summary(preds):
        print(line)
    print()
    for key, text in SOURCES.items():
        print(f"- {key}: {text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
