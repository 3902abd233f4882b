"""The one adapter to torch's private pipelining names: it refuses a torch that lacks one (naming
it), warns on an untested version, and observes sends/receives on the calling thread only."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from pipeplan.client import torch_internals
from torch.distributed.pipelining import schedules

pytestmark = pytest.mark.torch


def test_a_torch_without_a_private_name_is_refused_by_name(monkeypatch):
    torch_internals._check()  # this torch has them all
    monkeypatch.delattr(schedules._PipelineScheduleRuntime, "_load_csv")
    monkeypatch.delattr(schedules.PipelineScheduleMulti, "_load_csv")  # the one it would inherit
    monkeypatch.delattr(schedules, "_wait_batch_p2p")
    with pytest.raises(ImportError, match=r"_wait_batch_p2p, _load_csv, which torch .* lacks; it is tested"):
        torch_internals._check()


def test_an_untested_torch_gets_one_warning(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    with pytest.warns(UserWarning, match="tested with torch 2.13, not 2.99.0"):
        torch_internals._check()


def test_sends_and_receives_are_observed_on_the_calling_thread_only():
    seen: list[tuple[str, str | None]] = []

    def batch(original, ops, desc):
        seen.append(("batch", desc))
        return original(ops, desc=desc)

    def wait(original, works):
        seen.append(("wait", None))
        original(works)

    other: list = []
    with torch_internals.p2p_hooks(batch, wait):
        schedules._wait_batch_p2p(schedules._batch_p2p([], desc="fwd_send"))
        thread = threading.Thread(target=lambda: other.append(schedules._batch_p2p([], desc="elsewhere")))
        thread.start()
        thread.join()
    schedules._wait_batch_p2p(schedules._batch_p2p([], desc="after"))
    assert seen == [("batch", "fwd_send"), ("wait", None)] and other == [[]]


def test_torch_s_split_backward_keeps_every_saved_activation_until_w():
    """The premise of planner.memory.held_until_w (and of the runtimes statement's torch peaks):
    torch's B (`stage_backward_input`) computes the input gradients with the graph retained for W,
    so no activation autograd saved is freed before W. Should a torch free them at B, this fails and
    held_until_w should go."""
    import weakref

    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    torch.manual_seed(0)
    stage = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16),
                                torch.nn.Tanh(), torch.nn.Linear(16, 16))
    weights = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    x = torch.randn(8, 16, requires_grad=True)
    saved: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights and t is not x:
            saved.append(weakref.ref(t))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(x)
    _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], stage.parameters())
    del out
    assert len(saved) >= 4 and all(r() is not None for r in saved)  # B freed nothing
    stage_backward_weight(stage.parameters(), groups)
    assert all(p.grad is not None for p in stage.parameters())
