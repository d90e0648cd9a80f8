"""Streams read ahead (``integrations.llama_cpp_server.read_ahead``): a thread per stream makes the chunks, bounded
ahead of the sender, with errors where they happened, and a consumer that stops ends the iterator in that thread."""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterator

import anyio
import pytest

from integrations.llama_cpp_server.read_ahead import Handoff, collect_streams, read_ahead, stop_streams


def counting(n: int, made: list[int], finished: threading.Event, fail_at: int | None = None) -> Iterator[int]:
    try:
        for i in range(n):
            if i == fail_at:
                raise ValueError(f"failed at {i}")
            made.append(i)
            yield i
    finally:
        made.append(-threading.get_ident())  # who ended it
        finished.set()


def run(main: Callable[[], Any]) -> Any:
    return anyio.run(main)


def test_items_arrive_in_order_and_an_error_where_it_happened() -> None:
    made: list[int] = []
    finished = threading.Event()

    async def main() -> list[int]:
        got = []
        with pytest.raises(ValueError, match="failed at 5"):
            async for item in read_ahead(counting(10, made, finished, fail_at=5), depth=2):
                got.append(item)
        return got

    assert run(main) == [0, 1, 2, 3, 4]
    assert finished.wait(5)


def test_the_thread_stays_a_bounded_number_of_items_ahead() -> None:
    made: list[int] = []
    finished = threading.Event()
    depth = 3

    async def main() -> list[int]:
        got = []
        async for item in read_ahead(counting(40, made, finished), depth=depth):
            await anyio.sleep(0.01)  # a slow client
            ahead = len([i for i in made if i >= 0]) - (len(got) + 1)
            # depth taken by the sender at once, depth waiting, one made and waiting for room
            assert ahead <= 2 * depth + 1, (made, got)
            got.append(item)
        return got

    assert run(main) == list(range(40))


def test_a_consumer_that_stops_ends_the_iterator_in_its_thread() -> None:
    made: list[int] = []
    finished = threading.Event()
    caller = threading.get_ident()

    async def main() -> None:
        streams = collect_streams()
        async for item in read_ahead(counting(10_000, made, finished), depth=2):
            if item == 3:
                break
        stop_streams(streams)  # what the server does when the request ends

    run(main)
    assert finished.wait(5), "the iterator was left open"
    ender = -made[-1]
    assert ender != caller  # closed by the stream's own thread, where it ran
    assert len([i for i in made if i >= 0]) < 10


def test_a_postponed_wake_delivers_items_when_it_fires_or_at_the_end() -> None:
    made: list[int] = []
    finished = threading.Event()
    wakes: list[Callable[[], None]] = []
    lock = threading.Lock()

    def postpone(wake: Callable[[], None]) -> None:
        with lock:
            wakes.append(wake)

    async def fire_later() -> None:
        while not finished.is_set():
            await anyio.sleep(0.005)
            with lock:
                pending, wakes[:] = list(wakes), []
            for wake in pending:
                wake()

    async def main() -> list[int]:
        got: list[int] = []
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(fire_later)
            async for item in read_ahead(counting(20, made, finished), depth=4, wake=postpone):
                got.append(item)
        return got

    assert run(main) == list(range(20))


def test_handoff_stop_wakes_a_waiting_producer_and_consumer() -> None:
    handoff = Handoff(1)
    assert handoff.put("a")
    results: list[Any] = []
    producer = threading.Thread(target=lambda: results.append(handoff.put("b")))  # waits: no room
    producer.start()
    assert handoff.take() == ["a"]
    producer.join(5)
    assert results == [True]
    assert handoff.take() == ["b"]
    consumer = threading.Thread(target=lambda: results.append(handoff.take()))  # waits: nothing there
    consumer.start()
    handoff.stop()
    consumer.join(5)
    assert not consumer.is_alive() and results[-1] == []
    assert handoff.put("c") is False
