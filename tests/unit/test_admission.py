"""The admission queue of parallel slots: first come first served, bounded, and a client that leaves while waiting
gives its place up (and a turn it was handed passes on)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from ckpt_plugin.http.admission_queue import AdmissionQueue, ServerBusy


def client() -> tuple[Any, Any]:
    """A ``receive`` that reports a disconnect once ``leave`` is set."""
    leave = anyio.Event()

    async def receive() -> dict[str, str]:
        await leave.wait()
        return {"type": "http.disconnect"}

    return receive, leave


def test_waiters_are_served_in_arrival_order_and_the_queue_is_bounded() -> None:
    async def main() -> None:
        admission = AdmissionQueue(capacity=2, max_queued=2)
        order: list[int] = []
        receive, _ = client()
        assert await admission.enter(receive) and await admission.enter(receive)
        assert admission.running == 2

        async def wait(i: int) -> None:
            assert await admission.enter(receive)
            order.append(i)

        async with anyio.create_task_group() as tasks:
            for i in range(2):
                tasks.start_soon(wait, i)
                await anyio.sleep(0.01)
            assert admission.queued == 2
            with pytest.raises(ServerBusy):
                await admission.enter(receive)  # past the queue: refused at once
            assert admission.refused == 1
            admission.leave()
            admission.leave()
        assert order == [0, 1] and admission.running == 2
        admission.leave()
        admission.leave()
        assert admission.running == 0 and admission.queued == 0

    anyio.run(main)


def test_a_client_that_leaves_while_waiting_gives_its_place_up() -> None:
    async def main() -> None:
        admission = AdmissionQueue(capacity=1, max_queued=4)
        receive, _ = client()
        assert await admission.enter(receive)
        gone_receive, leave = client()
        results: list[bool] = []

        async def wait(receive_: Any) -> None:
            results.append(await admission.enter(receive_))

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(wait, gone_receive)
            await anyio.sleep(0.01)
            tasks.start_soon(wait, receive)
            await anyio.sleep(0.01)
            assert admission.queued == 2
            leave.set()  # the first waiter's client disconnects
            await anyio.sleep(0.01)
            assert results == [False] and admission.queued == 1
            admission.leave()  # the running one ends: the second waiter runs
        assert results == [False, True] and admission.running == 1

    anyio.run(main)
