"""Suite-wide test setup.

Tests marked `cuda` run only where torch sees a CUDA GPU; elsewhere they are skipped, saying why.
torch is imported only when a collected test carries the marker, so runs without the torch extra
are unaffected.

Hypothesis profiles: the default run keeps a property test to a quick number of examples
(support/examples.py) where its property is also pinned down by targeted tests;
HYPOTHESIS_PROFILE=thorough (or pytest's own `--hypothesis-profile=thorough`) runs each of them at
its thorough number, for a change to the code those tests cover."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

settings.register_profile("thorough")  # the numbers of examples themselves: support.examples.examples
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def _cuda_missing() -> str | None:
    """Why CUDA tests cannot run here (None when they can)."""
    try:
        import torch
    except ImportError:
        return "needs torch (the torch extra) built with CUDA"
    if not torch.cuda.is_available():
        return (f"needs a CUDA GPU: torch {torch.__version__} sees none (torch.cuda.is_available() is"
                " False); bench/gpu_check.sh runs these on a GPU machine")
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not marked:
        return
    reason = _cuda_missing()
    if reason is not None:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=reason))
