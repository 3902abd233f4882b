"""service.flight.single_flight: one run per key at a time, its result or exception shared by every
concurrent caller; nothing kept once it ends."""

from __future__ import annotations

import asyncio

import pytest
from pipeplan.service.flight import single_flight


def test_concurrent_callers_share_one_run_and_a_later_call_runs_again():
    runs = 0

    async def work() -> int:
        nonlocal runs
        runs += 1
        await asyncio.sleep(0.05)
        return runs

    async def main() -> tuple[list[int], int]:
        inflight: dict = {}
        results = await asyncio.gather(*(single_flight(inflight, "k", work) for _ in range(10)))
        assert inflight == {}
        return results, await single_flight(inflight, "k", work)

    results, later = asyncio.run(main())
    assert results == [1] * 10
    assert later == 2


def test_an_exception_reaches_every_waiter():
    async def work() -> None:
        await asyncio.sleep(0.05)
        raise ValueError("broken")

    async def main() -> list:
        inflight: dict = {}
        return await asyncio.gather(*(single_flight(inflight, "k", work) for _ in range(3)),
                                    return_exceptions=True)

    outcomes = asyncio.run(main())
    assert [type(o) for o in outcomes] == [ValueError] * 3


def test_a_cancelled_waiter_leaves_the_run_going():
    async def work() -> str:
        await asyncio.sleep(0.1)
        return "done"

    async def main() -> str:
        inflight: dict = {}
        owner = asyncio.ensure_future(single_flight(inflight, "k", work))
        await asyncio.sleep(0.01)
        waiter = asyncio.ensure_future(single_flight(inflight, "k", work))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return await owner

    assert asyncio.run(main()) == "done"
