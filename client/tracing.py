"""Recording one rank's measured ops during an iteration, and gathering them into a trace.

Times: on CPU a monotonic clock (`time.perf_counter`), relative to the iteration's start, which every
rank takes right after a barrier; on CUDA, CUDA events recorded on the stream the op ran on
(compute, or a copy lane's stream), resolved against a start event once the iteration is over, so
recording never synchronizes the device mid-iteration.

Memory: on CUDA, the caching allocator's high-water mark while each compute op ran
(`torch.cuda.max_memory_allocated`, reset before the op); on CPU, the saved-activation bytes the
executor's hooks hold on the "device" (what the plan's memory model counts), sampled at every op
boundary.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from pipeplan.planner.trace import PIPEPLAN_RUNTIME, DeviceTrace, Trace, TraceOp, measured_makespan

MIB = float(1 << 20)


class OpRecorder:
    """Thread-safe log of (kind, stage, mb, start, end, memory) for one rank's iteration."""

    def __init__(self, device: torch.device, held_bytes: Callable[[], int]):
        self.device = device
        self.cuda = device.type == "cuda"
        self._held_bytes = held_bytes
        self._lock = threading.Lock()
        self._entries: list[tuple[str, int, int, Any, Any, float | None]] = []
        self._start: Any = None
        self.peak_mib = 0.0

    # -- clock ------------------------------------------------------------------------------------------
    def begin_iteration(self) -> None:
        with self._lock:
            self._entries = []
            self.peak_mib = self.memory_mib()
        self._start = self.mark()

    def mark(self, stream: Any = None) -> Any:
        """A time marker: a float on CPU; on CUDA an event recorded on `stream` (default: current)."""
        if self.cuda:  # CUDA only: timing events on the stream the op was issued to
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def _ms(self, marker: Any) -> float:
        if self.cuda:
            return float(self._start.elapsed_time(marker))
        return (marker - self._start) * 1000.0

    # -- memory -----------------------------------------------------------------------------------------
    def memory_mib(self) -> float:
        if self.cuda:  # CUDA only: allocator statistics, no device synchronization
            return torch.cuda.max_memory_allocated(self.device) / MIB
        return self._held_bytes() / MIB

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    # -- ops --------------------------------------------------------------------------------------------
    def add(self, kind: str, stage: int, mb: int, start: Any, end: Any, memory_mib: float | None = None) -> None:
        if memory_mib is None:
            memory_mib = self.memory_mib()
        with self._lock:
            self._entries.append((kind, stage, mb, start, end, memory_mib))
            self.peak_mib = max(self.peak_mib, memory_mib)

    def device_trace(self, rank: int) -> DeviceTrace:
        """Resolve the markers (on CUDA this synchronizes: call it after the iteration)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        with self._lock:
            entries = list(self._entries)
        ops = [TraceOp(kind=kind, stage=stage, mb=mb, start_ms=self._ms(s), end_ms=max(self._ms(s), self._ms(e)),
                       memory_mib=mem) for kind, stage, mb, s, e, mem in entries]
        ops.sort(key=lambda o: (o.start_ms, o.end_ms))
        return DeviceTrace(device=rank, ops=ops, peak_memory_mib=self.peak_mib,
                           memory_source="cuda_allocator" if self.cuda else "saved_tensors")


def assemble_trace(devices: list[DeviceTrace], problem_key: str, revision: int, *, iteration: int,
                   cuda: bool, emulated: bool, metadata: dict | None = None) -> Trace:
    """One trace document from every rank's measurements, saying which runtime made it (its split
    backward is torch's, which calibration needs to know)."""
    devices = sorted(devices, key=lambda d: d.device)
    return Trace(problem_key=problem_key, revision=revision, iteration=iteration,
                 clock="cuda_events" if cuda else "monotonic",
                 device_kind="emulated" if emulated else ("cuda" if cuda else "cpu"),
                 makespan_ms=measured_makespan(devices), devices=devices,
                 metadata={"runtime": PIPEPLAN_RUNTIME, **(metadata or {})})
