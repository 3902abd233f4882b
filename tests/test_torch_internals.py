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
