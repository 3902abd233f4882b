"""A plan as torchtitan (0.3.x) command-line overrides: the CSV and everything that must agree with it.

torchtitan loads a custom schedule with `--parallelism.pipeline_parallel_schedule_csv`, but starts
only when the rest agrees with the CSV (read from torchtitan 0.3.0's `config/configs.py`,
`distributed/pipeline_parallel.py` and `trainer.py`):

- `pipeline_parallel_degree` = the plan's devices;
- `module_fqns_per_model_part`: one list of module names per stage, from our partition
  (`tok_embeddings`, `layers.<i>`, `norm` + `lm_head`), so torchtitan cuts the model where we did;
- `pipeline_parallel_schedule` decides the placement even when a CSV is given
  (`_get_pp_rank_to_stage_indices_mapping`): V only for ZBVZeroBubble / DualPipeV (two stages per
  rank), loop for every other name. We name ZBVZeroBubble for V and, for loop, the classes
  torchtitan's help names for CSV schedules (PipelineScheduleSingle / PipelineScheduleMulti);
  with a CSV the runtime is `_PipelineScheduleRuntime` whatever the name;
- microbatches = `training.local_batch_size` / `pipeline_parallel_microbatch_size`, so both are set;
- `training.disable_cuda_graphs`: torchtitan refuses pipeline parallelism with CUDA graphs;
- `activation-checkpoint:none` (a tyro subcommand, so the last argument): the plan's memory and
  times count every activation kept; torchtitan's model configs default to selective recompute.

Microbatch size and sequence length come from the problem's metadata (the cost model writes them);
a problem without them gets micro-batch size 1 and no sequence length, and the notes say so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .contract import Plan, Problem
from .exports import ExportRefused, TorchSchedule, placement_of, stage_layers, torch_schedule

BLOCKS = frozenset({"dense", "moe", "mamba", "attention", "mlp"})


@dataclass(frozen=True)
class TorchtitanExport:
    """The CSV's schedule (`schedule.csv(problem)`), the overrides (one per line) and notes."""

    schedule: TorchSchedule
    args: list[str]
    notes: list[str] = field(default_factory=list)

    def args_text(self) -> str:
        return "\n".join(self.args) + "\n"


def module_fqns(problem: Problem) -> list[list[str]]:
    """torchtitan module names per stage: embedding -> tok_embeddings, block i -> layers.i, LM head ->
    norm + lm_head (the final norm runs right before the head)."""
    out, block = [], 0
    for k, types in enumerate(stage_layers(problem)):
        names = []
        for t in types:
            if t == "embedding":
                names.append("tok_embeddings")
            elif t == "lm_head":
                names += ["norm", "lm_head"]
            elif t in BLOCKS:
                names.append(f"layers.{block}")
                block += 1
            else:
                raise ExportRefused(f"metadata.layers: stage {k} holds a {t!r} layer, which torchtitan's"
                                    " pipeline split has no module for (plan the model without it)")
        out.append(names)
    return out


def schedule_class(problem: Problem) -> str:
    """The `pipeline_parallel_schedule` name that gives torchtitan our placement."""
    placement = placement_of(problem)
    if placement == "loop":
        return "PipelineScheduleSingle" if problem.chunks == 1 else "PipelineScheduleMulti"
    if placement == "v" and problem.chunks == 2:
        return "ZBVZeroBubble"
    devices = [s.device for s in problem.stages]
    raise ExportRefused(f"stages: torchtitan places stages loop (stage k on rank k mod P) or V (two stages"
                        f" per rank, k and 2P-1-k); this problem's placement {devices} is neither")


def torchtitan_export(problem: Problem, plan: Plan, csv_path: str) -> TorchtitanExport:
    """Overrides for torchtitan with the plan's CSV at `csv_path` (as the training job sees it)."""
    if any(c.isspace() for c in csv_path):
        raise ExportRefused(f"csv path {csv_path!r}: contains whitespace, which would split the argument")
    fqns = module_fqns(problem)
    name = schedule_class(problem)
    schedule = torch_schedule(problem, plan)
    notes = list(schedule.notes)
    model = problem.metadata.get("model") if isinstance(problem.metadata.get("model"), dict) else {}
    mbs = model.get("micro_batch_size")
    if not (isinstance(mbs, int) and mbs >= 1):
        mbs = 1
        notes.append("metadata.model.micro_batch_size is not given: micro-batch size 1 assumed")
    blocks = sum(1 for names in fqns for n in names if n.startswith("layers."))
    args = [
        f"--parallelism.pipeline_parallel_degree {problem.num_devices}",
        f"--parallelism.pipeline_parallel_schedule {name}",
        f"--parallelism.pipeline_parallel_schedule_csv {csv_path}",
        f"--parallelism.pipeline_parallel_microbatch_size {mbs}",
        "--parallelism.module_fqns_per_model_part " + " ".join(",".join(names) for names in fqns),
        f"--training.local_batch_size {problem.num_microbatches * mbs}",
    ]
    seq_len = model.get("seq_len")
    if isinstance(seq_len, int) and seq_len >= 1:
        args.append(f"--training.seq_len {seq_len}")
    args += ["--training.disable_cuda_graphs", "activation-checkpoint:none"]
    notes.append(f"the torchtitan model (--module/--config) must have {blocks} transformer layers"
                 f" (layers.0..layers.{blocks - 1}) as the plan's model does; keep activation-checkpoint:none"
                 " the last argument (it is a subcommand) and put your own overrides before these")
    return TorchtitanExport(schedule, args, notes)


__all__ = ["TorchtitanExport", "module_fqns", "schedule_class", "torchtitan_export"]
