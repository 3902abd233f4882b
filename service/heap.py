"""Give freed heap back to the OS after a request that built a big plan's objects.

Reading a P=64 M=512 plan into pydantic objects, drawing its charts or its 1F1B baseline creates
hundreds of MB of short-lived objects. Python frees them, but glibc keeps the freed pages in its
arenas, so the API process would stay at its high-water mark for good. After such a response
(a background task: the client already has its bytes) the cycle collector runs and glibc is asked to
return what is free (`malloc_trim`). Elsewhere (musl, macOS) this is only the collection.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from functools import cache

from starlette.background import BackgroundTask

BIG_PLAN_OPS = 20_000  # below this a page's objects are a few MB: not worth a collection


@cache
def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release() -> None:
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def release_after(ops: int) -> BackgroundTask | None:
    """A background task that releases memory, for responses built from a plan of `ops` ops."""
    return BackgroundTask(release) if ops >= BIG_PLAN_OPS else None
