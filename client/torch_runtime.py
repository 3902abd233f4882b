"""Run a pipeplan plan in torch.distributed.pipelining (the `torch` extra).

The schedule goes through torch's own loader (`_PipelineScheduleRuntime._load_csv`, compute_only).
"""

from __future__ import annotations

import os
import tempfile

from torch.distributed.pipelining.schedules import _Action, _PipelineScheduleRuntime


def parse_torch_csv(csv_text: str, num_ranks: int, num_stages: int, n_microbatches: int
                    ) -> tuple[dict[int, list[_Action]], dict[int, list[_Action]], dict[int, int]]:
    """Load a schedule CSV with torch's own `_load_csv`, without a process group or stages.

    Returns (compute-only order, order lowered with send/recv, stage -> rank). Raises whatever torch
    raises for a malformed schedule, so a CSV that passes here is one the runtime accepts.
    """
    runtime = _PipelineScheduleRuntime.__new__(_PipelineScheduleRuntime)
    runtime.pipeline_order = {}
    runtime.pp_group_size = num_ranks
    runtime._num_stages = num_stages
    runtime._n_microbatches = n_microbatches
    runtime._stages = []
    runtime._defer_pp_recv = False
    fd, path = tempfile.mkstemp(suffix=".csv")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(csv_text)
        runtime._load_csv(path, format="compute_only")
    finally:
        os.unlink(path)
    return runtime.pipeline_order, runtime.pipeline_order_with_comms, runtime.stage_index_to_group_rank
