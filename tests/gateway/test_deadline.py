"""gateway.relay.Deadline: asyncio.timeout's behaviour (the attempt's wait for its answer's head)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.relay import Deadline


def test_an_expired_deadline_leaves_as_a_timeout_and_the_task_is_not_left_cancelling() -> None:
    async def main() -> int:
        never = asyncio.get_running_loop().create_future()
        with pytest.raises(TimeoutError):
            async with Deadline(0.0):
                await never
        task = asyncio.current_task()
        assert task is not None
        return task.cancelling()

    assert asyncio.run(main()) == 0


def test_a_cancel_from_elsewhere_stays_a_cancel() -> None:
    async def body(entered: asyncio.Event) -> None:
        async with Deadline(3600.0):
            entered.set()
            await asyncio.get_running_loop().create_future()

    async def main() -> None:
        entered = asyncio.Event()
        task = asyncio.create_task(body(entered))
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_a_block_that_ends_in_time_is_left_alone() -> None:
    async def main() -> str:
        async with Deadline(3600.0):
            await asyncio.sleep(0)
        await asyncio.sleep(0)  # a cancelled timer never fires later
        return "done"

    assert asyncio.run(main()) == "done"
