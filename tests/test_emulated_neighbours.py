"""One rank of a 4-rank plan run alone, its neighbours emulated (client.emulated_neighbours), on CPU.

The same one-rank path runs on a GPU in tests/test_cuda_runtime.py; here it runs in emulated time
(20-ms ops) so the planned arrivals are checkable on a loaded 2-core machine.
"""

from __future__ import annotations

import gc
import weakref

import pytest

torch = pytest.importorskip("torch")

from pipeplan.client.emulated_neighbours import (
    arrivals,
    one_rank_schedule,
    predicted_rank_end,
    single_process_group,
)
from pipeplan.client.emulated_pipeline import make_blocks
from pipeplan.client.emulation import Emulation
from torch_ranks import emulated_problem, planned

pytestmark = pytest.mark.torch
WIDTH = 16


def test_arrivals_are_the_producers_planned_ends_plus_the_link():
    problem = emulated_problem(m=4, unit_ms=10.0, copy_ms=10.0, p2p_ms=1.0)
    plan = planned(problem, offload=set(), recompute=set())
    ends = {(p.kind, p.stage, p.mb): p.end_ms for d in plan.devices for p in d.ops}
    got = arrivals(problem, plan, 1)
    assert set(got) == {(kind, 1, mb) for kind in ("RECV_F", "RECV_B") for mb in range(4)}
    for mb in range(4):
        assert got[("RECV_F", 1, mb)] == ends[("F", 0, mb)] + 1.0
        assert got[("RECV_B", 1, mb)] == ends[("B", 2, mb)] + 1.0
    assert all(kind == "RECV_B" for kind, _, _ in arrivals(problem, plan, 0))  # the first rank is fed


def _run(problem, plan, rank: int, iterations: int = 2, synchronous: bool = False):
    blocks = make_blocks(problem.num_stages, WIDTH)
    run = one_rank_schedule(problem, plan, rank, {k: blocks[k] for k in problem.stages_of(rank)},
                            torch.zeros(2, WIDTH), emulation=Emulation(problem), synchronous_copies=synchronous)
    try:
        for _ in range(iterations):
            for block in blocks:
                block.zero_grad(set_to_none=True)
            run.step()
        return run.schedule.local_trace(), run, [p.grad.clone() for k in problem.stages_of(rank)
                                                 for p in blocks[k].parameters()]
    finally:
        run.close()


@pytest.mark.integration
def test_the_predicted_rank_end_is_the_plans_and_synchronous_copies_add_the_overlap():
    problem = emulated_problem(m=4, unit_ms=20.0, copy_ms=20.0, p2p_ms=1.0)
    offload = planned(problem, offload={(1, mb) for mb in range(4)}, recompute=set())
    for rank in range(4):
        planned_end = max(p.end_ms for p in offload.devices[rank].ops)
        assert predicted_rank_end(problem, offload, rank) == pytest.approx(planned_end)
    # rank 1's copies (4 x 2 x 20 ms) hide behind compute but for what waits on a receive anyway
    assert predicted_rank_end(problem, offload, 1, synchronous_copies=True) == pytest.approx(345.0 + 76.0)
    assert predicted_rank_end(problem, offload, 0, synchronous_copies=True) == pytest.approx(366.0)


def test_one_rank_meets_every_receive_at_its_planned_time_and_trains_as_without_offload():
    """Rank 1 (a middle rank: receives both ways) of a plan offloading all its microbatches: every
    op that consumes a receive starts after the receive's planned arrival, the rank ends near the
    plan's end for it, nothing ran late, and its gradients equal (to rounding) the same rank's
    without offload. With synchronous copies it ends later by about the overlap predicted for it."""
    problem = emulated_problem(m=4, unit_ms=20.0, copy_ms=20.0, p2p_ms=1.0)
    plain = planned(problem, offload=set(), recompute=set())
    offload = planned(problem, offload={(1, mb) for mb in range(4)}, recompute=set())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the emulated ranks do: intra-op threads only contend with the lanes
    try:
        with single_process_group():
            trace, run, grads = _run(problem, offload, 1)
            _, _, plain_grads = _run(problem, plain, 1)
            sync_trace, _, _ = _run(problem, offload, 1, synchronous=True)
    finally:
        torch.set_num_threads(threads)
    assert run.schedule.executor.stats.late == []
    assert run.schedule.executor.stats.offloaded_bytes and run.schedule.executor.stats.reloads
    ops = {(o.kind, o.stage, o.mb): o for o in trace.ops}
    due = arrivals(problem, offload, 1)
    for (kind, k, mb), at in due.items():
        consumer = ops[("F" if kind == "RECV_F" else "B", k, mb)]
        assert consumer.start_ms >= at - 0.5, (kind, mb, consumer.start_ms, at)
        assert ops[(kind, k, mb)].end_ms >= at - 0.5
    planned_end = max(p.end_ms for p in offload.devices[1].ops)
    measured_end = max(o.end_ms for o in trace.ops)
    assert abs(measured_end - planned_end) <= 0.2 * planned_end, (measured_end, planned_end)
    overlap = predicted_rank_end(problem, offload, 1, synchronous_copies=True) - planned_end
    saved = max(o.end_ms for o in sync_trace.ops) - measured_end
    assert 0.6 * overlap <= saved <= 1.4 * overlap, (saved, overlap)
    # reloaded tensors may sit at other addresses, so the kernels' blocking (and rounding) can differ
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-9) for a, b in zip(grads, plain_grads))


def test_offload_moves_each_activation_once_and_never_a_weight():
    """A Llama-like block on (batch, seq, width) input saves transposed weights (views of the
    parameters) and several views of one tensor (each linear layer's reshaped input): the executor
    offloads exactly the saved activations the profiler measures, each once, and no weight."""
    from pipeplan.client.profiler import profile_stack

    from bench.llama_stage import make_stage

    problem = emulated_problem(m=2, unit_ms=1.0, copy_ms=1.0, p2p_ms=0.0)
    offload = planned(problem, offload={(1, 0), (1, 1)}, recompute=set())
    block = make_stage(256, 1, torch.float32, torch.device("cpu"))[0]
    example = torch.randn(1, 64, 256)
    (group,) = profile_stack([("dense", block)], example, repeats=1)
    activation = group["activation_mib"] * 2**20 - example.numel() * 4  # the output is sent, not saved
    with single_process_group():
        run = one_rank_schedule(problem, offload, 1, {1: block}, torch.zeros_like(example))
        try:
            run.step()
        finally:
            run.close()
    moved = run.schedule.executor.stats.offloaded_bytes
    assert set(moved) == {(1, 0), (1, 1)}
    assert all(n == pytest.approx(activation, rel=1e-6) for n in moved.values()), (moved, activation)


def _live_tensor_bytes() -> int:
    """Bytes of every distinct storage a live Python tensor points at (after a collection)."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_an_iteration_keeps_nothing_after_it_ends_and_a_closed_rank_is_freed():
    """Found on an H100, where the fourth run of bench/fidelity.py --cuda ran out of 80 GB: the
    saved tensors autograd was handed back as themselves made cycles through its C++ graph that
    Python's collector cannot see, so every iteration's un-offloaded activations stayed alive, and
    the copy lanes' finished jobs kept every reloaded activation on the device until the next
    iteration. Now the tensors alive after the fourth iteration are those after the second, and a
    closed rank's executor is collected (no hook left on its modules)."""
    problem = emulated_problem(m=4, unit_ms=1.0, copy_ms=1.0, p2p_ms=0.1)
    plan = planned(problem, offload={(1, 0), (1, 2)}, recompute=set())
    blocks = make_blocks(problem.num_stages, WIDTH)
    with single_process_group():
        run = one_rank_schedule(problem, plan, 1, {1: blocks[1]}, torch.zeros(64, WIDTH))
        executor = weakref.ref(run.schedule.executor)
        live = []
        try:
            for _ in range(4):
                blocks[1].zero_grad(set_to_none=True)
                run.step()
                live.append(_live_tensor_bytes())
        finally:
            run.close()
        assert run.schedule.executor.stats.reloads == {(1, 0), (1, 2)}
        del run
    gc.collect()  # (the one-process group's own references go with it)
    assert live[3] == live[1], live
    assert executor() is None
