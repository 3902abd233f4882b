"""The configuration search against the published layouts: for each published H100 run, the same
model, GPU count, global batch, sequence, precision and framework settings searched from scratch.

    .venv/bin/python bench/configure.py --quick        # two small rows (under a minute)
    .venv/bin/python bench/configure.py                # every row (long: the 1024-GPU rows dominate)
    .venv/bin/python bench/configure.py --only llama3  # rows whose id contains "llama3"
    .venv/bin/python bench/configure.py --llama70b     # the 64-GPU timing target (first answer, complete)

Per row: the published layout's predicted tokens/s per GPU (bench/published.py's prediction: its own
schedule, Megatron's interleaved 1F1B or 1F1B, on its own partition), the same degrees with the search's
balanced partition and fast first plan (how much of the gain is the partition alone), the best
configuration found and its prediction, their ratio, the search time, whether the published layout is in
our top 3, and where we choose differently, why (the loss the published layout's family shows against
ours: bubble, TP collectives, ...). The published layout is in the search space
(planner/configure_space.py keeps the spec's partition and settings), and the search is a branch and
bound on proven bounds, so the ratio is at least 1 -- unless the published layout does not fit the GPU's
memory under our model (the prediction is then without a limit, the search's with one: the row says so).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeplan.planner.configure import Configurations, ConfigureError, configure, score, why_lost
from pipeplan.planner.configure_space import ConfigureRequest, Layout
from pipeplan.planner.spec import Spec

from bench.published import predict
from bench.published_runs import RUNS, Run

QUICK = ("llama2-13b", "nemotron-22b")


def published_layout(run: Run) -> Layout:
    placement = "loop"
    partition = "spec" if run.layers_per_stage else "uniform"
    return Layout(run.tp, run.cp, run.ep, run.pp, run.dp, run.vp, placement, run.mbs, run.microbatches,
                  run.precision, partition)


def search(run: Run, top: int = 3, on_progress=None) -> Configurations:
    doc = run.spec()
    doc["training"].pop("memory_budget_gib")  # the GPU's memory
    spec = Spec.model_validate(doc)
    request = ConfigureRequest(gpus=run.gpus, gpus_per_node=8, global_batch=run.gbs,
                               micro_batch_sizes=sorted({1, 2, 4, run.mbs}), max_cp=max(8, run.cp), top=top)
    return configure(spec, request, on_progress=on_progress, max_scheduled=400)


def row(run: Run) -> tuple[str, float]:
    pub = predict(run)
    started = time.monotonic()
    result = search(run)
    seconds = time.monotonic() - started
    best, mine = result.best, published_layout(run)
    try:
        ours = score(result.spec, result.request, mine)  # the published layout, scored as the search does
    except ConfigureError as exc:
        ours, why = None, f"{best.layout.name}; the published layout: {exc.reason}"
    try:  # the published degrees with the search's balanced partition and fast first plan
        balanced = score(result.spec, result.request, dataclasses.replace(mine, partition="balanced")).tokens
    except ConfigureError:
        balanced = float("nan")
    in_top3 = ours is not None and any(c.key == ours.key for c in result.scheduled[:3])
    if ours is not None:
        why = "the published layout" if best.key == ours.key else \
            f"{changes(mine, best.layout)}; the published layout loses on {why_lost(ours, best)}"
    ratio = best.tokens / pub.tokens
    fits = "" if pub.fits else " (published over HBM in our model)"
    top3 = "yes" if in_top3 else "no"
    line = (f"| {run.id} | {run.layout} MBS{run.mbs} | {pub.tokens:,.0f}{fits} | {balanced:,.0f} |"
            f" {best.tokens:,.0f} | {ratio:.3f} | {seconds:.1f} | {result.first_ranked_s or 0:.1f} | {top3} | {why} |")
    return line, ratio


def changes(published: Layout, best: Layout) -> str:
    """What we choose differently, e.g. "TP 4->8, PP 8->2, CP 1->2, VP5->VP20, partition uniform->balanced"."""
    def schedule(lay: Layout) -> str:
        return "V" if lay.placement == "v" else f"VP{lay.vp}" if lay.vp > 1 else "1F1B"

    out = [f"{name} {a}->{b}" for name, a, b in (
        ("TP", published.tp, best.tp), ("PP", published.pp, best.pp), ("CP", published.cp, best.cp),
        ("EP", published.ep, best.ep), ("MBS", published.mbs, best.mbs)) if a != b]
    if schedule(published) != schedule(best):
        out.append(f"{schedule(published)}->{schedule(best)}")
    if published.partition != best.partition:
        out.append(f"partition {published.partition}->{best.partition}")
    return ", ".join(out) or "same degrees"


HEADER = ("| run | published layout | published predicted tok/s/GPU | same degrees, balanced partition | best found |"
          " ratio | search s | first answer s | published in top 3 | why we choose differently |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---|---|")


def llama70b() -> None:
    """The issue's target: 64 H100s, Llama-3-70B, global batch 256 of 8k tokens."""
    run = next(r for r in RUNS if r.id == "llama3-70b-gbs256")
    started = time.monotonic()
    result = search(run, top=10)
    print(f"Llama-3-70B, 64 x H100 (8 per node), GBS 256 x 8192: first ranked answer"
          f" {result.first_ranked_s:.1f} s, complete {time.monotonic() - started:.1f} s;"
          f" {result.enumerated} layouts, {len(result.scheduled)} scheduled;"
          f" best {result.best.layout.name} {result.best.tokens:,.0f} tok/s/GPU")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    ap.add_argument("--only", help="rows whose id contains this")
    ap.add_argument("--llama70b", action="store_true", help="time the 64-GPU Llama-3-70B search only")
    args = ap.parse_args(argv)
    if args.llama70b:
        llama70b()
        return 0
    runs = [r for r in RUNS if (not args.quick or r.id in QUICK) and (not args.only or args.only in r.id)]
    print(HEADER)
    ratios = []
    for run in runs:
        line, ratio = row(run)
        ratios.append(ratio)
        print(line, flush=True)
    print()
    print(f"Median ratio (best found / published layout, both predicted): {statistics.median(ratios):.3f} over"
          f" {len(ratios)} runs; worst {min(ratios):.3f}.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
