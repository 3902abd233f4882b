"""Adaptive partitioning benchmark (issue 7): heterogeneous models on 8 and 16 devices.

For each model and pipeline size, at the same per-device memory limit:
  * uniform partition + interleaved 1F1B (loop, 2 stages per device) — Megatron-LM's default;
  * uniform partition + ZB-V (V placement, 2 stages per device);
  * pipeplan's adaptive search (partition x placement x schedule, then the optimizer on the best).
The memory limit of every device is the peak that Megatron's default actually uses (uniform +
interleaved 1F1B at the HBM limit, + 1 MiB): the adaptive plan may not use more memory than it.
Prints a table of predicted iteration times (the simulator's makespan) and speed-ups.

    PYTHONPATH=. .venv/bin/python bench/adaptive.py [--time-limit 20] [--devices 8 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeplan.planner import baselines
from pipeplan.planner.adaptive import plan_adaptive
from pipeplan.planner.costmodel import build_problem, layer_costs
from pipeplan.planner.partition import uniform_partition
from pipeplan.planner.spec import Spec

MODELS: dict[str, dict] = {
    # Gemma-2-9B-like: 256k vocabulary, tied embeddings; the LM head costs about 4 blocks.
    "gemma-9b-like (256k vocab)": {
        "name": "gemma-9b-like", "layers": 42, "hidden": 3584, "ffn": 14336, "heads": 16, "kv_heads": 8,
        "head_dim": 256, "vocab": 256000, "seq_len": 4096, "tie_embeddings": True},
    # Qwen3-30B-A3B-like MoE (128 experts, top-8) with a dense first layer and a DeepSeek-V3-style
    # multi-token-prediction head.
    "moe-30b-a3b-like (+dense, +MTP)": {
        "name": "moe-30b-like", "layers": 48, "hidden": 2048, "ffn": 6144, "heads": 32, "kv_heads": 4,
        "head_dim": 128, "vocab": 151936, "seq_len": 4096, "experts": 128, "top_k": 8, "moe_ffn": 768,
        "first_dense_layers": 1, "mtp_heads": 1},
    # Nemotron-H-8B-like hybrid: Mamba-2, attention and MLP layers in Megatron's hybrid pattern.
    "hybrid-8b-like (Mamba/attn/MLP)": {
        "name": "hybrid-8b-like", "hidden": 4096, "ffn": 21504, "heads": 32, "kv_heads": 8,
        "vocab": 131072, "seq_len": 4096, "gated_mlp": False,
        "pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"},
}


def spec_for(model: dict, devices: int, budget_gib: float | None = None) -> Spec:
    return Spec.model_validate({
        "model": model, "hardware": "H100-80GB",
        "training": {"devices": devices, "microbatches": 4 * devices, "dp_shards": 8,
                     "memory_budget_gib": budget_gib},
    })


def uniform_problem(spec: Spec, placement: str):
    costs = layer_costs(spec)
    return build_problem(spec, uniform_partition([c.type for c in costs], 2 * spec.training.devices),
                         placement, 2, costs)


def baseline(spec: Spec, placement: str, name: str):
    problem = uniform_problem(spec, placement)
    try:
        return baselines.run_baseline(problem, name)
    except (baselines.DoesNotFit, baselines.NotApplicable) as exc:
        print(f"  {name} on uniform {placement}: {exc}", file=sys.stderr)
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=20.0, help="adaptive seconds per case")
    parser.add_argument("--devices", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    rows = []
    for label, model in MODELS.items():
        for devices in args.devices:
            inter = baseline(spec_for(model, devices), "loop", "interleaved-1f1b")
            budget = (max(inter.peak_memory_mib) + 1.0) / 1024 if inter else None
            spec = spec_for(model, devices, budget)
            zbv = baseline(spec, "v", "zb-v")
            # the schedule's share of the gain: the best heuristic on Megatron's own partition
            uni = uniform_problem(spec, "loop")
            try:
                best_uni = baselines.best_heuristic(uni)
            except Exception as exc:  # noqa: BLE001 - reported, not fatal
                print(f"  best heuristic on uniform loop: {exc}", file=sys.stderr)
                best_uni = None
            t0 = time.monotonic()
            result = plan_adaptive(spec, time_limit_s=args.time_limit)
            took = time.monotonic() - t0
            ada = result.plan
            limit = result.problem.devices[0].memory_limit_mib
            row = {
                "model": label, "devices": devices, "microbatches": spec.training.microbatches,
                "interleaved_1f1b_ms": inter.makespan_ms if inter else None,
                "interleaved_1f1b_peak_mib": max(inter.peak_memory_mib) if inter else None,
                "zb_v_ms": zbv.makespan_ms if zbv else None,
                "uniform_best_heuristic_ms": best_uni.makespan_ms if best_uni else None,
                "uniform_best_heuristic": best_uni.method if best_uni else None,
                "zb_v_peak_mib": max(zbv.peak_memory_mib) if zbv else None,
                "adaptive_ms": ada.makespan_ms, "adaptive_peak_mib": max(ada.peak_memory_mib),
                "limit_mib": limit, "adaptive_choice": f"{result.best.label} / {result.best.schedule}",
                "layers_per_stage": [b - a for a, b in result.problem.metadata["partition"]],
                "candidates": len(result.candidates), "seconds": round(took, 1),
            }
            rows.append(row)
            print(f"{label} P={devices}: 1F1B-I {row['interleaved_1f1b_ms']}, ZB-V {row['zb_v_ms']},"
                  f" adaptive {ada.makespan_ms:.1f} ({row['adaptive_choice']}, {took:.0f} s)", file=sys.stderr)

    def ms(x):
        return f"{x:,.0f}" if x is not None else "n/a"

    print("| model | P | M | uniform + interleaved 1F1B (ms) | uniform + ZB-V (ms) |"
          " uniform + best heuristic (ms) | adaptive (ms) | speed-up vs 1F1B-I | vs ZB-V |"
          " peak / limit GiB (1F1B-I, ZB-V, adaptive) | adaptive choice |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    speedups = []
    for r in rows:
        s1 = r["interleaved_1f1b_ms"] / r["adaptive_ms"] if r["interleaved_1f1b_ms"] else None
        s2 = r["zb_v_ms"] / r["adaptive_ms"] if r["zb_v_ms"] else None
        if s1:
            speedups.append(s1)
        gib = lambda x: f"{x / 1024:.1f}" if x is not None else "-"
        print(f"| {r['model']} | {r['devices']} | {r['microbatches']} | {ms(r['interleaved_1f1b_ms'])} |"
              f" {ms(r['zb_v_ms'])} | {ms(r['uniform_best_heuristic_ms'])} | {ms(r['adaptive_ms'])} | {(f'{s1:.2f}x' if s1 else '-')} |"
              f" {(f'{s2:.2f}x' if s2 else '-')} | {gib(r['interleaved_1f1b_peak_mib'])},"
              f" {gib(r['zb_v_peak_mib'])}, {gib(r['adaptive_peak_mib'])} / {gib(r['limit_mib'])} |"
              f" {r['adaptive_choice']} ({','.join(map(str, r['layers_per_stage']))}) |")
    if speedups:
        print(f"\naverage speed-up over uniform interleaved 1F1B: {statistics.mean(speedups):.2f}x"
              f" (geometric {statistics.geometric_mean(speedups):.2f}x, min {min(speedups):.2f}x,"
              f" max {max(speedups):.2f}x)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
