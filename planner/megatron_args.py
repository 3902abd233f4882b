"""A plan as Megatron-LM arguments: the partition as a pipeline layout, recompute as close as it goes.

Megatron-LM takes no external op order: it runs its own 1F1B (interleaved 1F1B with virtual stages),
full backward, no per-microbatch offload. What it does take is the partition and the placement,
through `--pipeline-model-parallel-layout` (megatron-core's `PipelineParallelLayerLayout`): one
string per virtual stage, joined by `|`, `E` embedding, `t` decoder layer, `m` MTP layer, `L` loss
(with the output layer), `x*N` and `(...|)*N` repeats, commas cosmetic; virtual stage i runs on rank
i mod PP, the loop placement. The number of virtual stages per rank follows from the layout (Megatron
refuses `--num-virtual-stages-per-pipeline-rank` beside one).

Recompute: Megatron recomputes the same layers for every microbatch of every stage
(`--recompute-granularity full` with `--recompute-method uniform|block` and
`--recompute-num-layers`). A plan that recomputes every (stage, microbatch) keeps only each stage's
input; `uniform` with N = the gcd of the stages' decoder-layer counts keeps one input per N layers,
exact when the stages hold equal layer counts (N larger than a stage's count would index past it).
A plan that recomputes only some pairs cannot be said: the flags then recompute all of them, more
compute than planned (the notes say how much) and less memory for the pairs the plan kept whole;
fitting in memory is why a plan recomputes, so the side that keeps memory low is chosen. Offload
has no per-microbatch form there (Megatron's fine-grained offloading moves given module inputs of
every layer): it is reported, not translated.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from functools import reduce

from .contract import Plan, Problem
from .exports import ExportRefused, placement_of, stage_layers

LAYER_CHARS = {"embedding": "E", "lm_head": "L", "mtp_head": "m", "dense": "t", "moe": "t"}
HYBRID = frozenset({"mamba", "attention", "mlp"})


@dataclass(frozen=True)
class MegatronExport:
    """Arguments as (flag, value or None) pairs, the layout, and what Megatron cannot express."""

    args: list[tuple[str, str | None]]
    layout: str
    virtual_stages: int
    cannot_express: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """One argument per line, values shell-quoted (a layout holds `|`, `*` and parentheses)."""
        return [flag if value is None else f"{flag} {shlex.quote(value)}" for flag, value in self.args]


def stage_strings(problem: Problem) -> list[str]:
    """Each stage's layers in Megatron's layout letters, the loss moved after the MTP layers (Megatron
    computes the loss last; our stack lists the LM head before the MTP heads)."""
    per_stage = []
    for k, types in enumerate(stage_layers(problem)):
        if HYBRID.intersection(types):
            raise ExportRefused(f"metadata.layers: stage {k} holds hybrid layers"
                                f" ({sorted(HYBRID.intersection(types))}); Megatron takes a hybrid model's"
                                " pipeline split in --hybrid-layer-pattern, not in a layout, and this export"
                                " does not write that pattern")
        unknown = [t for t in types if t not in LAYER_CHARS]
        if unknown:
            raise ExportRefused(f"metadata.layers: stage {k} holds {unknown[0]!r}, which Megatron's layout"
                                " has no letter for")
        per_stage.append([LAYER_CHARS[t] for t in types])
    flat = [c for s in per_stage for c in s]
    if flat.count("E") != 1 or flat[0] != "E" or flat.count("L") != 1:
        raise ExportRefused("metadata.layers: Megatron's layout needs the embedding first and exactly one"
                            " LM head (the loss)")
    mtp_stages = sorted({k for k, s in enumerate(per_stage) if "m" in s})
    if len(mtp_stages) > 1:
        raise ExportRefused(f"metadata.partition: the MTP heads are spread over stages {mtp_stages};"
                            " Megatron needs all MTP layers in one virtual stage")
    for s in per_stage:
        if "L" in s:
            s.remove("L")
    per_stage[-1].append("L")
    return ["".join(s) for s in per_stage]


def layout_string(stages: list[str]) -> str:
    """Megatron's layout syntax for per-stage strings, repeats compressed: "Et*3|(tt|)*29,m|L"."""

    def stage(text: str) -> str:
        out, i = [], 0
        while i < len(text):
            j = i
            while j < len(text) and text[j] == text[i]:
                j += 1
            out.append(text[i] * (j - i) if j - i < 3 else f"{text[i]}*{j - i}")
            i = j
        return "".join(out)

    runs: list[list] = []
    for text in stages:
        if runs and runs[-1][0] == text:
            runs[-1][1] += 1
        else:
            runs.append([text, 1])
    segments: list[tuple[str, bool]] = []  # (text, is a "(s|)*n" group, which ends its stages with "|")
    for n, (text, count) in enumerate(runs):
        tail = n == len(runs) - 1 and count > 1  # a trailing group would add an empty stage: end on one
        grouped = count - 1 if tail else count
        if grouped > 1:
            segments.append((f"({stage(text)}|)*{grouped}", True))
        elif grouped == 1:
            segments.append((stage(text), False))
        if tail:
            segments.append((stage(text), False))
    out = segments[0][0]
    for (_, was_group), (text, _) in zip(segments, segments[1:]):
        out += ("," if was_group else "|") + text
    return out


def _recompute(problem: Problem, plan: Plan, decoder_counts: list[int]
               ) -> tuple[list[tuple[str, str | None]], list[str]]:
    """Megatron's recompute flags for the plan's RECOMPUTE choices, and what they cannot say."""
    planned = {(p.stage, p.mb) for dp in plan.devices for p in dp.ops if p.kind == "RECOMPUTE"}
    if not planned:
        return [], []
    counts = [c for c in decoder_counts if c > 0]
    n = reduce(math.gcd, counts) if counts else 1
    flags: list[tuple[str, str | None]] = [
        ("--recompute-granularity", "full"), ("--recompute-method", "uniform"), ("--recompute-num-layers", str(n))]
    said = []
    if n < max(counts, default=n):
        said.append(f"a recomputed stage keeps one input per {n} decoder layer(s), not one per stage as"
                    " planned (Megatron's uniform method needs a count dividing every stage's, here"
                    f" {sorted(set(counts))})")
    everything = problem.num_stages * problem.num_microbatches
    if len(planned) < everything:
        extra = [0.0] * problem.num_devices
        for k, stage in enumerate(problem.stages):
            missing = sum(1 for i in range(problem.num_microbatches) if (k, i) not in planned)
            extra[stage.device] += missing * stage.recompute_ms
        stages = sorted({k for k, _ in planned})
        said.append(f"the plan recomputes {len(planned)} of {everything} (stage, microbatch) pairs (stages"
                    f" {stages}); Megatron recomputes every microbatch of every stage alike, so these flags"
                    f" recompute all: up to {max(extra):.2f} ms more compute per iteration on one device than"
                    " planned, less memory for the pairs the plan kept whole")
    return flags, said


def megatron_export(problem: Problem, plan: Plan, data_parallel: int = 1) -> MegatronExport:
    """Megatron-LM arguments for the plan's problem (the partition, placement and recompute)."""
    if data_parallel < 1:
        raise ValueError(f"data_parallel: must be >= 1, got {data_parallel}")
    if placement_of(problem) != "loop":
        raise ExportRefused(f"stages: Megatron-LM runs virtual stage i on rank i mod PP (loop placement);"
                            f" this problem's placement {[s.device for s in problem.stages]} is not that"
                            " (plan with placement \"loop\" for Megatron)")
    p, m, chunks = problem.num_devices, problem.num_microbatches, problem.chunks
    if chunks > 1 and m % p:
        raise ExportRefused(f"num_microbatches: Megatron's interleaved schedule (virtual stages) needs the"
                            f" microbatches ({m}) to be a multiple of the pipeline size ({p})")
    stages = stage_strings(problem)
    mtp_stage = next((k for k, s in enumerate(stages) if "m" in s), None)
    if mtp_stage is not None and mtp_stage < problem.num_stages - p:
        raise ExportRefused(f"metadata.partition: the MTP heads are in stage {mtp_stage}; Megatron needs them"
                            " in the last virtual stage of a rank")
    layout = layout_string(stages)
    decoders = [s.count("t") for s in stages]
    model = problem.metadata.get("model") if isinstance(problem.metadata.get("model"), dict) else {}
    notes, cannot = [], [
        "the op order: Megatron runs its own schedule (1F1B, interleaved 1F1B with virtual stages) with"
        " full backwards, not the plan's order or its B/W split; the plan's figures are for its own order"]
    mbs = model.get("micro_batch_size")
    if not (isinstance(mbs, int) and mbs >= 1):
        mbs = 1
        notes.append("metadata.model.micro_batch_size is not given: micro-batch size 1 assumed")
    args: list[tuple[str, str | None]] = [
        ("--pipeline-model-parallel-size", str(p)),
        ("--pipeline-model-parallel-layout", layout),
        ("--num-layers", str(sum(decoders))),
    ]
    mtp = sum(s.count("m") for s in stages)
    if mtp:
        args.append(("--mtp-num-layers", str(mtp)))
    args += [("--micro-batch-size", str(mbs)), ("--global-batch-size", str(m * mbs * data_parallel))]
    seq_len = model.get("seq_len")
    if isinstance(seq_len, int) and seq_len >= 1:
        args.append(("--seq-length", str(seq_len)))
    flags, said = _recompute(problem, plan, decoders)
    args += flags
    cannot += said
    head = next((k for k, types in enumerate(stage_layers(problem)) if "lm_head" in types), None)
    if head is not None and head != problem.num_stages - 1:
        cannot.append(f"the LM head's place: Megatron computes the loss in the last stage, after the MTP"
                      f" layers; the plan put the LM head in stage {head}")
    offloads = {(op.stage, op.mb) for dp in plan.devices for op in dp.ops if op.kind == "OFFLOAD"}
    if offloads:
        cannot.append(f"offload: the plan offloads {len(offloads)} (stage, microbatch) activations; Megatron"
                      " has no per-microbatch offload (its fine-grained offloading moves given module inputs"
                      " of every layer, which this plan did not time): plan with options.offload false for"
                      " Megatron, or expect more memory than planned")
    notes.append(f"virtual stages per rank: {chunks} (Megatron derives them from the layout; do not also"
                 " pass --num-virtual-stages-per-pipeline-rank)")
    if data_parallel == 1:
        notes.append("--global-batch-size assumes data-parallel size 1; --data-parallel N for N replicas")
    return MegatronExport(args, layout, chunks, cannot, notes)


__all__ = ["MegatronExport", "layout_string", "megatron_export", "stage_strings"]
