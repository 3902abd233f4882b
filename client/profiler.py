"""Measure a torch model's per-layer F, B (input), W (weight) times and saved-activation bytes.

The result is a `stack` of profiled `LayerGroup`s for a model spec (planner.costmodel): each number
replaces exactly the estimate it names, so the cost model's other fields (memory of weights and
optimizer state, links) still apply. Timings: median of `repeats` runs after a warm-up; on CUDA with
CUDA events between F, B and W queued back to back (`_timer`), on CPU with a monotonic clock.

B and W are measured as torch's split backward spends them, by its own functions (the ones
`PipelineStage` calls): B = `stage_backward_input`, the layer's input gradient (the whole chain of
activation gradients, kept for W), W = `stage_backward_weight`, the weight gradients from what B
kept. Timing a full backward less B under-counts W by the bookkeeping of the split (on an H100 at
width 4096 the run's W took 1.29x that), and timing a weight pass of its own over-counts it, walking
the activation gradients again (1.68x the run's backward on an H200; docs/torch.md, "On a GPU").
Saved-activation bytes = what autograd saves during the forward (saved-tensor hooks, parameters and
the layer's input excluded, views of one tensor counted once) plus the output the next layer receives.
Output-gradient bytes = what B leaves in torch's param groups for W (the gradients of the
weight-consuming ops' outputs), which torch holds beside the activation until W: on an H200 the
allocator grew by exactly this across B (docs/torch.md, "On a GPU").
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

MIB = float(1 << 20)


def _timer(device: torch.device) -> Callable[[list[Callable[[], Any]]], list[float]]:
    """Times a sequence of passes run back to back (ms each). On CUDA with an event between each
    two and one synchronization at the end, so the host queues a pass's kernels while the GPU runs
    the previous one, as in a training step: synchronizing around each pass would add the host's
    launch time to every short one (the run's W took 0.74x such a profile's on an H200)."""
    if device.type == "cuda":  # CUDA only: events between the passes, synchronized at the end
        def cuda_ms(works: list[Callable[[], Any]]) -> list[float]:
            events = [torch.cuda.Event(enable_timing=True) for _ in range(len(works) + 1)]
            torch.cuda.synchronize(device)
            events[0].record()
            for work, event in zip(works, events[1:]):
                work()
                event.record()
            torch.cuda.synchronize(device)
            return [float(a.elapsed_time(b)) for a, b in zip(events, events[1:])]
        return cuda_ms

    def cpu_ms(works: list[Callable[[], Any]]) -> list[float]:
        took = []
        for work in works:
            started = time.perf_counter()
            work()
            took.append((time.perf_counter() - started) * 1000.0)
        return took
    return cpu_ms


def profile_layer(layer: nn.Module, x: torch.Tensor, *, repeats: int = 5
                  ) -> tuple[dict[str, float], torch.Tensor]:
    """One layer's profiled numbers for input `x`, and its output (the next layer's input)."""
    device = x.device
    timer = _timer(device)
    params = [p for p in layer.parameters() if p.requires_grad]
    x = x.detach().requires_grad_(x.is_floating_point())

    saved: dict[tuple[int, int, int], int] = {}
    resident = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        # views of parameters (a transposed weight) and of the input are not activations; views of
        # one activation count once
        if t.untyped_storage().data_ptr() not in resident:
            where = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
            saved[where] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    out_tensor = out[0] if isinstance(out, tuple) else out
    activation_bytes = sum(saved.values()) + out_tensor.numel() * out_tensor.element_size()
    grad = torch.randn_like(out_tensor)

    from .torch_internals import output_grad_bytes, stage_backward_input, stage_backward_weight

    f, b, w = [], [], []
    for n in range(repeats + 1):
        held: dict[str, Any] = {}

        def forward() -> None:
            o = layer(x)
            held["out"] = o[0] if isinstance(o, tuple) else o

        def backward_input() -> None:
            inputs = [x] if x.requires_grad else []
            held["groups"] = stage_backward_input([held["out"]], [grad], inputs, iter(params))[1]

        def output_for_b() -> None:  # B detaches the output in place, which a view (a linear layer's
            if held["out"]._is_view():  # output on 3-d input) refuses; its backward is a no-op
                held["out"] = held["out"].clone()

        def backward_weight() -> None:
            stage_backward_weight(iter(params), held["groups"])
        took_f, _, took_b, took_w = timer([forward, output_for_b, backward_input,
                                           backward_weight if params else _nothing])
        if n:  # the first run warms caches and kernels up
            f.append(took_f), b.append(took_b), w.append(took_w if params else 0.0)
        x.grad = None  # a stage's input is new each microbatch; its weights' gradients accumulate
    kept = 0
    if params:  # once more, untimed: what B leaves for W (W takes it out of the groups)
        for work in (forward, output_for_b, backward_input):
            work()
        kept = output_grad_bytes(held["groups"])
        backward_weight()
        x.grad = None
    numbers = {"forward_ms": statistics.median(f), "backward_input_ms": statistics.median(b),
               "backward_weight_ms": statistics.median(w),
               "activation_mib": activation_bytes / MIB, "output_grad_mib": kept / MIB,
               "params": float(sum(p.numel() for p in layer.parameters()))}
    return numbers, out_tensor.detach()


def _nothing() -> None:
    pass


def profile_stack(layers: list[tuple[str, nn.Module]], example: torch.Tensor, *, repeats: int = 5
                  ) -> list[dict[str, Any]]:
    """Profile `layers` (type, module) in order, feeding each the previous one's output.

    Returns one LayerGroup document per layer (count 1). A layer without an input gradient (the
    embedding) gets a tiny backward_input_ms, since the spec requires a positive one.
    """
    groups = []
    x = example
    for kind, layer in layers:
        numbers, x = profile_layer(layer, x, repeats=repeats)
        numbers["forward_ms"] = max(numbers["forward_ms"], 1e-4)
        numbers["backward_input_ms"] = max(numbers["backward_input_ms"], 1e-4)
        groups.append({"type": kind, "count": 1, **{k: round(v, 6) for k, v in numbers.items()}})
    return groups
