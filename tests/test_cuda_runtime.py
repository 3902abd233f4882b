"""The runtime's CUDA paths on a GPU: copy streams, pinned buffers, events, CUDA-event traces and
allocator statistics (skipped where torch sees no GPU; bench/gpu_check.sh runs them on one).

Rank 1 of a 4-rank plan runs alone, its neighbours emulated (client.emulated_neighbours): small
residual MLP blocks (width 1024, 4096 rows per microbatch, float32: the tanh's 32 MiB output is the
one activation a microbatch saves), stage 1 offloading every microbatch. Each test takes a few
seconds on one H100.
"""

from __future__ import annotations

import gc
import itertools

import pytest

torch = pytest.importorskip("torch")

from pipeplan.client.emulated_neighbours import arrivals, one_rank_schedule, single_process_group
from pipeplan.client.emulated_pipeline import make_blocks
from torch_ranks import emulated_problem, planned

pytestmark = [pytest.mark.torch, pytest.mark.cuda]
WIDTH, ROWS, RANK, M = 1024, 4096, 1, 4
COMPUTE = ("F", "B", "W", "BW", "RECOMPUTE")


def _problem(unit_ms: float):
    return emulated_problem(m=M, unit_ms=unit_ms, copy_ms=unit_ms, p2p_ms=0.0 if unit_ms < 1 else 1.0)


def _run(problem, plan, *, synchronous: bool = False, iterations: int = 2):
    """The last iteration's trace, the executor, stage 1's gradients, and the allocator's peak above
    what was allocated when the iteration began (MiB)."""
    gc.collect()
    torch.cuda.empty_cache()
    blocks = make_blocks(problem.num_stages, WIDTH)
    modules = {k: blocks[k].cuda() for k in problem.stages_of(RANK)}
    with single_process_group():
        run = one_rank_schedule(problem, plan, RANK, modules, torch.zeros(ROWS, WIDTH, device="cuda"),
                                synchronous_copies=synchronous)
        try:
            for _ in range(iterations):
                for module in modules.values():
                    module.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated() / 2**20
                run.step()
            trace = run.schedule.local_trace()
        finally:
            run.close()
    grads = [p.grad.detach().clone() for m in modules.values() for p in m.parameters()]
    return trace, run.schedule.executor, grads, trace.peak_memory_mib - base


def _ops(trace, kinds) -> list:
    return sorted((o for o in trace.ops if o.kind in kinds), key=lambda o: o.start_ms)


def test_offloaded_handle_goes_to_pinned_host_memory_and_back_on_the_copy_streams():
    from pipeplan.client.torch_runtime import _Offloaded

    d2h, h2d = torch.cuda.Stream(), torch.cuda.Stream()
    compute = torch.cuda.current_stream()
    assert len({d2h.cuda_stream, h2d.cuda_stream, compute.cuda_stream}) == 3
    x = torch.randn(ROWS, WIDTH, device="cuda").t()  # saved transposed, as a linear layer's weight view
    want = x.clone()
    handle = _Offloaded(x)
    how = handle.view_of(x)
    del x
    assert handle.to_host(d2h) == ROWS * WIDTH * 4
    assert handle.dev is None and handle.host.is_pinned()
    d2h.synchronize()
    assert handle.to_device(h2d, compute) == ROWS * WIDTH * 4
    compute.wait_stream(h2d)
    assert handle.dev.is_cuda and torch.equal(handle.view(how), want)


def test_lanes_overlap_copies_with_compute_and_every_backward_waits_for_its_own_reload():
    """Ops a few µs long in the plan: the host never waits for a receive, so the GPU has compute
    queued while the copies run. With lanes some copy overlaps compute on the GPU's clock; each
    OFFLOAD ends before its RELOAD starts and each RELOAD before its B; the gradients equal the
    un-offloaded run's. With synchronous copies no copy overlaps compute."""
    problem = _problem(0.01)
    plain = planned(problem, offload=set(), recompute=set())
    offload = planned(problem, offload={(RANK, mb) for mb in range(M)}, recompute=set())
    trace, executor, grads, _ = _run(problem, offload)
    streams = executor._streams
    assert streams["d2h"] != streams["h2d"] and torch.cuda.current_stream() not in streams.values()
    assert executor.stats.late == [] and len(executor.stats.reloads) == M
    assert all(n > 0 for n in executor.stats.freed_bytes.values())  # device memory really released
    ops = {(o.kind, o.mb): o for o in trace.ops if o.stage == RANK}
    for mb in range(M):
        assert ops[("OFFLOAD", mb)].end_ms <= ops[("RELOAD", mb)].start_ms + 0.01, mb
        assert ops[("RELOAD", mb)].end_ms <= ops[("B", mb)].start_ms + 0.01, mb
    copies, compute = _ops(trace, ("OFFLOAD", "RELOAD")), _ops(trace, COMPUTE)

    def overlapping(c) -> bool:
        return any(c.start_ms < f.end_ms - 0.01 and f.start_ms < c.end_ms - 0.01 for f in compute)
    assert any(overlapping(c) for c in copies)
    _, _, plain_grads, _ = _run(problem, plain)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(grads, plain_grads))

    sync_trace, sync_executor, sync_grads, _ = _run(problem, offload, synchronous=True)
    assert set(sync_executor._streams.values()) == {torch.cuda.current_stream()}
    copies, compute = _ops(sync_trace, ("OFFLOAD", "RELOAD")), _ops(sync_trace, COMPUTE)
    assert copies and not any(overlapping(c) for c in copies)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(sync_grads, plain_grads))


def test_cuda_event_trace_is_ordered_and_receives_arrive_when_planned():
    """5-ms ops in the plan, far longer than the real ones: every op that consumes a receive starts
    (on the GPU's clock) after the receive's planned arrival; the compute ops follow each other on
    the compute stream, each F before its B before its W; durations are positive."""
    problem = _problem(5.0)
    offload = planned(problem, offload={(RANK, mb) for mb in range(M)}, recompute=set())
    trace, _, _, _ = _run(problem, offload)
    assert trace.memory_source == "cuda_allocator"
    assert all(o.end_ms > o.start_ms for o in trace.ops if o.kind in (*COMPUTE, "OFFLOAD", "RELOAD"))
    compute = _ops(trace, COMPUTE)
    assert all(a.end_ms <= b.start_ms + 0.01 for a, b in itertools.pairwise(compute))
    ops = {(o.kind, o.stage, o.mb): o for o in trace.ops}
    for mb in range(M):
        f, b, w = (ops[(kind, RANK, mb)] for kind in ("F", "B", "W"))
        assert f.end_ms <= b.start_ms + 0.01 and b.end_ms <= w.start_ms + 0.01, mb
    for (kind, k, mb), at in arrivals(problem, offload, RANK).items():
        consumer = ops[("F" if kind == "RECV_F" else "B", k, mb)]
        assert consumer.start_ms >= at - 0.2, (kind, mb, consumer.start_ms, at)


class _HostWork(torch.nn.Module):
    """Host time before a stage's first kernel, as torch's walk of B's graph before B's."""

    def forward(self, x):
        import time

        time.sleep(HOST_S)
        return x


HOST_S = 0.003


def test_the_host_queues_what_a_receive_gates_while_the_gpu_waits_for_it():
    """As with a NCCL receive, the GPU waits for an emulated arrival and the host goes on: a forward
    that spends 3 ms on the host before its first kernel still starts its kernels at the arrival, so
    its traced span (from the arrival, on the GPU's clock) is its kernels' alone. A host that waited
    for the arrival would add the 3 ms to every forward."""
    problem = _problem(5.0)
    plan = planned(problem, offload=set(), recompute=set())
    blocks = make_blocks(problem.num_stages, WIDTH)
    modules = {k: torch.nn.Sequential(_HostWork(), blocks[k]).cuda() for k in problem.stages_of(RANK)}
    with single_process_group():
        run = one_rank_schedule(problem, plan, RANK, modules, torch.zeros(ROWS, WIDTH, device="cuda"))
        try:
            for _ in range(2):
                run.step()
            trace = run.schedule.local_trace()
        finally:
            run.close()
    compute = _ops(trace, COMPUTE)
    free_at = {(o.kind, o.stage, o.mb): before.end_ms for before, o in itertools.pairwise(compute)}
    waited = 0
    for (kind, k, mb), at in arrivals(problem, plan, RANK).items():
        if kind != "RECV_F":
            continue
        f = next(o for o in compute if (o.kind, o.stage, o.mb) == ("F", k, mb))
        assert at - 0.2 <= f.start_ms <= max(at, free_at.get(("F", k, mb), 0.0)) + 1.0, (mb, f.start_ms, at)
        if f.start_ms <= at + 1.0:  # it waited for its arrival on an idle GPU
            waited += 1
            assert f.end_ms - f.start_ms < 1000 * HOST_S, (mb, f.end_ms - f.start_ms)
    assert waited >= 2


def test_allocator_peak_with_offload_is_below_the_unoffloaded_peak():
    """The plain plan holds up to 3 microbatches' activations on rank 1 (32 MiB each); offloading
    every one of them keeps the allocator's high-water mark at least half a microbatch lower."""
    problem = _problem(0.01)
    plain = planned(problem, offload=set(), recompute=set())
    offload = planned(problem, offload={(RANK, mb) for mb in range(M)}, recompute=set())
    _, _, _, plain_peak = _run(problem, plain)
    _, _, _, offload_peak = _run(problem, offload)
    one_mb = ROWS * 2 * WIDTH * 4 / 2**20  # the tanh's output (what the down projection and tanh save)
    assert plain_peak >= 2 * one_mb, plain_peak
    assert offload_peak <= plain_peak - 0.5 * one_mb, (offload_peak, plain_peak)
