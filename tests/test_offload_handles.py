"""The offload executor's handles (client.torch_runtime._Offloaded) on CPU: a saved tensor goes to
the host and back with its values, whatever its layout, and saved views of one block of memory share
one handle (one copy); tests/test_cuda_runtime.py does the same on a GPU with pinned buffers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pipeplan.client.torch_runtime import _Offloaded, _region

pytestmark = pytest.mark.torch


def _round_trip(handle: _Offloaded) -> None:
    assert handle.to_host() == handle.nbytes and handle.dev is None and handle.host is not None
    assert handle.to_device() == handle.nbytes and handle.host is None


def test_views_of_one_block_share_a_handle_and_come_back_with_their_values():
    a = torch.randn(2, 3, 4)
    views = [a, a.reshape(6, 4), a.transpose(0, 1), a.permute(2, 0, 1)]  # one block, four layouts
    assert len({_region(v) for v in views}) == 1
    handle = _Offloaded(a)
    hows = [handle.view_of(v) for v in views]
    want = [v.clone() for v in views]
    del a, views
    _round_trip(handle)
    assert handle.nbytes == 2 * 3 * 4 * 4
    for how, expected in zip(hows, want):
        got = handle.view(how)
        assert got.shape == expected.shape and torch.equal(got, expected)


def test_a_strided_slice_is_its_own_region_and_is_copied_as_it_is():
    a = torch.randn(4, 6)
    part = a[:, ::2]  # gaps between its elements: not the block's region
    assert _region(part) != _region(a)
    handle = _Offloaded(part)
    how, want = handle.view_of(part), part.clone()
    _round_trip(handle)
    assert handle.nbytes == 4 * 3 * 4 and torch.equal(handle.view(how), want)
