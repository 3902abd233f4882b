"""Tests marked `cuda` run only where torch sees a CUDA GPU; elsewhere they are skipped, saying why.

torch is imported only when a collected test carries the marker, so runs without the torch extra
are unaffected."""

from __future__ import annotations

import pytest


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
