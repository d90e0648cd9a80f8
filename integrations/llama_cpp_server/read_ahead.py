"""Streams read ahead: a request's chunks are made by a thread of its own while the event loop sends earlier ones.

``llama_cpp.server`` streams a completion with Starlette's ``iterate_in_threadpool``: every chunk is one trip from
the event loop to a worker thread and back, and the host's generator only asks for its next token once the event
loop has taken the previous chunk. With parallel slots that round trip sits between two batched steps for every
slot, and the event loop serves the slots one after another, so a step waits for the slowest of them.
:func:`read_ahead` has the same contract (an async iterator over a blocking iterator, each item made with the
caller's context variables) but one thread drives the iterator to its end, a bounded number of chunks ahead of the
sender: a slot's next token is submitted as soon as its chunk is made, and the event loop is woken for the chunk
when that token's step starts (at once if a step is decoding), so that sending it runs while llama.cpp computes.
On asyncio (uvicorn) the stream's thread wakes the event loop itself (``call_soon_threadsafe``) rather than the loop
waiting for each chunk in a worker thread: one wake-up a chunk instead of a worker thread's trip there and back.

A consumer that stops (its client left, the request was cancelled) stops the thread: it makes no further chunk,
and closes the iterator in its own thread, which frees the slot.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections import deque
from typing import AsyncIterator, Callable, Iterable, Iterator, TypeVar

import anyio
import sniffio
from starlette.concurrency import iterate_in_threadpool

from ckpt_plugin.hosts.llama_cpp.parallel.submissions import at_next_step

T = TypeVar("T")

DEFAULT_DEPTH = 8
"""Chunks waiting for the sender before a stream's thread waits (a slow client holds its slot): the sender takes
every waiting chunk at once, so the thread is at most ``2 * depth + 1`` chunks ahead of what was sent."""


class _Raised:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()


class Handoff:
    """Items passed from one producing thread to one consumer, at most ``capacity`` waiting.

    :param capacity: The most items waiting; :meth:`put` blocks while that many wait.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.stopped = False
        self._items: deque[object] = deque()
        self._cond = threading.Condition()
        self._waiter: Callable[[], None] | None = None  # an event loop consumer's wake-up (take_or_wait), once

    def _wake(self) -> None:
        """Wake the consumer, in a thread or on an event loop (the lock held)."""
        self._cond.notify_all()
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter()

    def put(self, item: object, notify: bool = True) -> bool:
        """Hand ``item`` over, waiting for room.

        :param notify: Wake the consumer now; else at the next :meth:`flush` (or when the items fill the room).
        :return: False, without handing it over, once stopped.
        """
        with self._cond:
            while len(self._items) >= self.capacity and not self.stopped:
                self._wake()
                self._cond.wait()
            if self.stopped:
                return False
            self._items.append(item)
            if notify:
                self._wake()
            return True

    def flush(self) -> None:
        """Wake the consumer for the items handed over without notice."""
        with self._cond:
            if self._items:
                self._wake()

    def take_or_wait(self, waiter: Callable[[], None]) -> list[object] | None:
        """Every item waiting, at once; if none, ``[]`` after registering ``waiter``, which the producer calls
        (once, from its thread, without blocking) when it next wakes the consumer. ``None`` once stopped."""
        with self._cond:
            if self.stopped:
                return None
            if self._items:
                items = list(self._items)
                self._items.clear()
                self._cond.notify_all()
                return items
            self._waiter = waiter
            return []

    def take(self) -> list[object]:
        """Every item waiting, after waiting for one. :return: an empty list once stopped."""
        with self._cond:
            while not self._items and not self.stopped:
                self._cond.wait()
            if self.stopped:
                return []
            items = list(self._items)
            self._items.clear()
            self._cond.notify_all()
            return items

    def stop(self) -> None:
        """No more items: a waiting :meth:`put` or :meth:`take` returns, and later ones do at once."""
        with self._cond:
            self.stopped = True
            self._wake()


Wake = Callable[[Callable[[], None]], None]
"""Postpones waking the consumer for an item: called with the wake-up once the item is handed over."""


def _produce(iterator: Iterator[object], handoff: Handoff, wake: Wake | None) -> None:
    try:
        for item in iterator:
            if not handoff.put(item, notify=wake is None):
                break
            if wake is not None:
                wake(handoff.flush)
        else:
            handoff.put(_END)
            return
    except BaseException as exc:  # the consumer raises it where the iterator raised it
        handoff.put(_Raised(exc))
        return
    # Stopped mid-way: end the iterator here, in the thread that ran it (a generator cannot be closed from
    # another thread while it runs).
    close = getattr(iterator, "close", None)
    if close is not None:
        try:
            close()
        except ValueError:
            pass  # a part of it is being closed by the request's end in another thread, which frees the slot


_stops: contextvars.ContextVar[list[Handoff] | None] = contextvars.ContextVar("ckpt_read_ahead_stops", default=None)


def collect_streams() -> list[Handoff]:
    """Start collecting the streams that :func:`read_ahead` begins in the current context (a request): stop them
    with :func:`stop_streams` when the request ends, whether or not their consumer was closed."""
    streams: list[Handoff] = []
    _stops.set(streams)
    return streams


def stop_streams(streams: list[Handoff]) -> None:
    """Stop every stream of ``streams`` (see :func:`collect_streams`)."""
    for handoff in streams:
        handoff.stop()


async def read_ahead(iterable: Iterable[T], depth: int = DEFAULT_DEPTH, wake: Wake | None = None
                     ) -> AsyncIterator[T]:
    """Iterate ``iterable`` in a thread of its own, up to ``depth`` items ahead (see the module docstring).

    :param wake: When the consumer is woken for an item (the end, an error and a full hand-off wake it at once);
        ``None``: as soon as the item is made.
    """
    handoff = Handoff(depth)
    streams = _stops.get()
    if streams is not None:
        streams.append(handoff)
    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(_produce, iter(iterable), handoff, wake),
                              name="ckpt-stream", daemon=True)
    thread.start()
    loop = _asyncio_loop()
    try:
        while True:
            if loop is not None:
                items = await _take_on_loop(handoff, loop)
            else:
                # abandon_on_cancel: a cancelled request does not wait for a chunk; stop() below wakes the taker.
                items = await anyio.to_thread.run_sync(handoff.take, abandon_on_cancel=True)
            if not items:
                return
            for item in items:
                if item is _END:
                    return
                if isinstance(item, _Raised):
                    raise item.error
                yield item  # type: ignore[misc]
    finally:
        handoff.stop()


def _asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The running asyncio loop, or ``None`` under another async library (trio)."""
    if sniffio.current_async_library() != "asyncio":
        return None
    return asyncio.get_running_loop()


async def _take_on_loop(handoff: Handoff, loop: asyncio.AbstractEventLoop) -> list[object]:
    """:meth:`Handoff.take` without a worker thread: the producer wakes the loop itself (one wake-up a chunk,
    where a worker thread's trip costs two and a thread switch; with every slot's chunk a step, those add up on
    the path to the next step). ``[]`` once stopped."""
    while True:
        ready = asyncio.Event()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:  # the loop closed (shutdown): nobody is waiting any more
                pass

        items = handoff.take_or_wait(wake)
        if items is None:
            return []
        if items:
            return items
        await ready.wait()


def iterate_chunks(iterable: Iterable[T]) -> AsyncIterator[T]:
    """:func:`read_ahead` in a request that collects its streams (:func:`collect_streams`: one served by parallel
    slots), else Starlette's ``iterate_in_threadpool`` (a request under the host's locks, whose ``interrupt_requests``
    check after each chunk must not find more chunks already made)."""
    if _stops.get() is None:
        return iterate_in_threadpool(iterable)
    # The event loop is woken for a chunk when the slot's next token goes into a step: sending it then runs while
    # llama.cpp computes, not while the other slots make their own chunks (see at_next_step).
    return read_ahead(iterable, wake=at_next_step)
