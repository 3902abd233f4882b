"""The private parts of torch.distributed.pipelining that pipeplan's runtime uses, in one place,
checked once against the installed torch.

torch has no public way to load a schedule CSV into a runtime, to observe a pipeline's sends and
receives, or to keep losses per microbatch, so pipeplan's runtime (`client.torch_runtime`) uses:

- `_PipelineScheduleRuntime`: `_load_csv` (which lowers a compute order to send/recv actions and
  infers stage -> rank), `pipeline_order_with_comms`, `stage_index_to_group_rank`, and its loss
  bookkeeping (`_maybe_compute_loss`, `_compute_loss`, `_maybe_get_loss`, `_update_losses`,
  `_internal_losses`), overridden by `KeyedLossRuntime`;
- the module functions `_batch_p2p` / `_wait_batch_p2p` through which every schedule sends and
  receives (`p2p_hooks`);
- a stage's `forward_one_chunk`, `backward_one_chunk`, `backward_weight_one_chunk` and
  `get_{fwd,bwd}_{send,recv}_ops` (not underscored, but undocumented), which the executor wraps;
- torch's split backward itself, `_backward.stage_backward_input` / `stage_backward_weight`, which
  the profiler (`client.profiler`) times as B and W;
- for one rank run alone (`client.emulated_neighbours`): a stage's `group_rank` / `group_size`, and,
  where the torch has them, `_warmup_forward_vote` / `_warmup_backward_result` (the neighbours' vote
  on static vs inferred shapes, which talks to them directly), replaced per stage
  (`assume_static_neighbours`); a torch without the vote has nothing to replace.

Private names change between releases: importing this module checks every one of them and raises
one ImportError naming what is missing, with the versions pipeplan was tested with; a torch outside
`TESTED` that has them all gets one warning. Sends and receives are observed by wrapping
`_batch_p2p` / `_wait_batch_p2p` once for the process with functions that call the originals
unless the calling thread is inside `p2p_hooks`: another schedule in the same process, on another
thread or outside a step, runs exactly as without pipeplan.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.pipelining import _backward
from torch.distributed.pipelining import schedules as _schedules
from torch.distributed.pipelining import stage as _stage

TESTED = ("2.13",)  # torch minor versions the runtime's tests pass on

_REQUIRED = (  # (owner, its names)
    (_backward, ("stage_backward_input", "stage_backward_weight")),
    (_schedules, ("_PipelineScheduleRuntime", "_Action", "_batch_p2p", "_wait_batch_p2p")),
    (getattr(_schedules, "_PipelineScheduleRuntime", None), (
        "_load_csv", "_maybe_compute_loss", "_compute_loss", "_maybe_get_loss", "_update_losses")),
    (getattr(_stage, "_PipelineStageBase", None), (
        "forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk", "get_fwd_send_ops",
        "get_bwd_send_ops", "get_fwd_recv_ops", "get_bwd_recv_ops")),
)


def _check() -> None:
    missing = [name for owner, names in _REQUIRED for name in names
               if owner is None or not hasattr(owner, name)]
    if missing:
        raise ImportError(f"pipeplan's torch runtime needs torch.distributed.pipelining's"
                          f" {', '.join(missing)}, which torch {torch.__version__} lacks; it is tested with"
                          f" torch {', '.join(TESTED)}")
    if ".".join(torch.__version__.split(".")[:2]) not in TESTED:
        warnings.warn(f"pipeplan's torch runtime is tested with torch {', '.join(TESTED)}, not"
                      f" {torch.__version__}; the private names it uses are present", stacklevel=3)


_check()
Action = _schedules._Action
stage_backward_input, stage_backward_weight = _backward.stage_backward_input, _backward.stage_backward_weight
ScheduleRuntime = _schedules._PipelineScheduleRuntime


def output_grad_bytes(param_groups: list[dict[str, Any]]) -> int:
    """Bytes of the gradients `stage_backward_input` left in its param groups for
    `stage_backward_weight` (each group's "grads": the gradients of the weight-consuming ops'
    outputs), each storage counted once. An empty list where B ran nothing."""
    sizes: dict[int, int] = {}
    for group in param_groups:
        for grads in group.get("grads") or ():
            for t in grads if isinstance(grads, (tuple, list)) else (grads,):
                if isinstance(t, torch.Tensor):
                    sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(sizes.values())


def load_csv_text(runtime: ScheduleRuntime, csv_text: str) -> None:
    """Load a compute-only schedule CSV into `runtime` with torch's own loader (it reads a file)."""
    fd, path = tempfile.mkstemp(suffix=".csv")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(csv_text)
        runtime._load_csv(path, format="compute_only")
    finally:
        os.unlink(path)


def parse_torch_csv(csv_text: str, num_ranks: int, num_stages: int, n_microbatches: int
                    ) -> tuple[dict[int, list[Action]], dict[int, list[Action]], dict[int, int]]:
    """Load a schedule CSV with torch's own `_load_csv`, without a process group or stages.

    Returns (compute-only order, order lowered with send/recv, stage -> rank). Raises whatever torch
    raises for a malformed schedule, so a CSV that passes here is one the runtime accepts.
    """
    runtime = ScheduleRuntime.__new__(ScheduleRuntime)
    runtime.pipeline_order = {}
    runtime.pp_group_size = num_ranks
    runtime._num_stages = num_stages
    runtime._n_microbatches = n_microbatches
    runtime._stages = []
    runtime._defer_pp_recv = False
    load_csv_text(runtime, csv_text)
    return runtime.pipeline_order, runtime.pipeline_order_with_comms, runtime.stage_index_to_group_rank


class KeyedLossRuntime(ScheduleRuntime):
    """torch's runtime, with losses kept per microbatch: a plan may run the last stage's forwards out
    of microbatch order (torch appends losses in call order and reads them by microbatch index)."""

    def _maybe_compute_loss(self, stage, output, target_mbs, mb_index, loss_kwargs=None):
        if stage.is_last and self._loss_fn is not None:
            # torch before 2.13 takes no loss_kwargs (2.11's _compute_loss(output, target))
            extra = (loss_kwargs,) if loss_kwargs is not None else ()
            loss = self._compute_loss(output, target_mbs[mb_index], *extra)  # type: ignore[index]
            self._losses_by_mb()[mb_index] = loss

    def _maybe_get_loss(self, stage, mb_index):
        if stage.is_last and self._loss_fn is not None:
            losses = self._losses_by_mb()
            if mb_index not in losses:
                raise RuntimeError(f"loss of microbatch {mb_index} is not available (forwards done:"
                                   f" {sorted(losses)})")
            return losses[mb_index]
        return None

    def _update_losses(self, stages, losses):
        by_mb = self._losses_by_mb()
        self._internal_losses[:] = [by_mb[i] for i in sorted(by_mb)]
        by_mb.clear()
        super()._update_losses(stages, losses)

    def _losses_by_mb(self) -> dict[int, torch.Tensor]:
        if not hasattr(self, "_pipeplan_losses"):
            self._pipeplan_losses: dict[int, torch.Tensor] = {}
        return self._pipeplan_losses


def assume_static_neighbours(stage: Any, rank: int, world: int) -> None:
    """Make `stage` (built in a one-process group) rank `rank` of `world`, whose neighbours all
    vote for the static shapes it was given: nothing is asked of ranks that are not there."""
    stage.group_rank, stage.group_size = rank, world
    if hasattr(stage, "_warmup_forward_vote"):  # torch's warm-up vote: every neighbour says "static"
        def static(*args: Any, **kwargs: Any) -> torch.Tensor:
            return torch.ones(1, dtype=torch.int32, device=stage.device)
        stage._warmup_forward_vote = static
        stage._warmup_backward_result = static


# -- sends and receives ------------------------------------------------------------------------------
BatchHook = Callable[[Callable[..., Any], list, Any], Any]  # (torch's _batch_p2p, p2p_ops, desc) -> works
WaitHook = Callable[[Callable[[Any], None], Any], None]  # (torch's _wait_batch_p2p, works)

_local = threading.local()
_install_lock = threading.Lock()
_installed = False


def _install() -> None:
    """Route torch's `_batch_p2p` / `_wait_batch_p2p` through this thread's hooks, once per process."""
    global _installed
    with _install_lock:
        if _installed:
            return
        batch, wait = _schedules._batch_p2p, _schedules._wait_batch_p2p

        def batch_p2p(p2p_ops, desc=None):
            hooks = getattr(_local, "hooks", None)
            return batch(p2p_ops, desc=desc) if hooks is None else hooks[0](batch, p2p_ops, desc)

        def wait_batch_p2p(works):
            hooks = getattr(_local, "hooks", None)
            return wait(works) if hooks is None else hooks[1](wait, works)

        _schedules._batch_p2p, _schedules._wait_batch_p2p = batch_p2p, wait_batch_p2p
        _installed = True


@contextlib.contextmanager
def p2p_hooks(batch: BatchHook, wait: WaitHook) -> Iterator[None]:
    """Within the block, on this thread only, torch's schedules send and receive through
    `batch(torch_batch_p2p, p2p_ops, desc)` and `wait(torch_wait_batch_p2p, works)`."""
    _install()
    outer = getattr(_local, "hooks", None)
    _local.hooks = (batch, wait)
    try:
        yield
    finally:
        _local.hooks = outer


__all__ = ["TESTED", "Action", "KeyedLossRuntime", "ScheduleRuntime", "assume_static_neighbours",
           "load_csv_text", "p2p_hooks", "parse_torch_csv"]
