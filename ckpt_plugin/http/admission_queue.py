"""Admission of generation requests to a server's slots: first come, first served, with a bounded queue.

With ``parallel`` slots, at most that many generations run at once; the next ``max_queued`` requests wait in
arrival order, and a request past them is refused at once (503) rather than left waiting without bound. A request
whose client disconnects while it waits leaves the queue without ever running.

Runs on the server's event loop only (no thread touches it), so it needs no lock.
"""

from __future__ import annotations

from collections import deque

import anyio
from starlette.types import Receive

__all__ = ["AdmissionQueue", "ServerBusy"]


class ServerBusy(Exception):
    """Every slot is busy and the queue is full."""


class AdmissionQueue:
    """At most ``capacity`` generations at once, ``max_queued`` more waiting (see the module docstring).

    :param capacity: Generations at once (the slots).
    :param max_queued: Requests that may wait.
    """

    def __init__(self, capacity: int, max_queued: int) -> None:
        if capacity < 1:
            raise ValueError("admission needs at least one slot")
        self.capacity = capacity
        self.max_queued = max_queued
        self.running = 0
        self._waiting: deque[anyio.Event] = deque()
        self.refused = 0

    @property
    def queued(self) -> int:
        """Requests waiting now."""
        return len(self._waiting)

    async def enter(self, receive: Receive) -> bool:
        """Wait for a turn; ``False`` if the client disconnected meanwhile (the request must not run).

        :param receive: The request's ``receive``, whose only message after the body is the disconnect.
        :raises ServerBusy: The queue is full.
        """
        if self.running < self.capacity and not self._waiting:
            self.running += 1
            return True
        if len(self._waiting) >= self.max_queued:
            self.refused += 1
            raise ServerBusy(
                f"all {self.capacity} slots are busy and {len(self._waiting)} requests are waiting; retry later")
        turn = anyio.Event()
        self._waiting.append(turn)
        gone = False
        try:
            async with anyio.create_task_group() as tasks:

                async def watch_client() -> None:
                    nonlocal gone
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    gone = True
                    tasks.cancel_scope.cancel()

                tasks.start_soon(watch_client)
                await turn.wait()
                tasks.cancel_scope.cancel()
        except BaseException:
            self._give_up(turn)
            raise
        if gone:
            self._give_up(turn)
            return False
        return True

    def _give_up(self, turn: anyio.Event) -> None:
        if turn.is_set():
            self.leave()  # handed a turn it will not use: pass it on
        else:
            self._waiting.remove(turn)

    def leave(self) -> None:
        """A generation admitted by :meth:`enter` is done: the next waiting request runs."""
        if self._waiting:
            self._waiting.popleft().set()  # the turn passes on: ``running`` stays the same
        else:
            self.running -= 1
