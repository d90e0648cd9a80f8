"""Fresh state buffers mapped ahead of time, at idle CPU priority.

A capture into a new anonymous mapping first makes the kernel fault in and zero every page: about 4 ms for the
7.9 MB checkpoint and 5 ms for the 14 MB full state of a Gemma-3-270M conversation, on the request path, each time
the prompt cache grows (nothing is freed that could be recycled). One daemon thread, scheduled ``SCHED_IDLE`` where
Linux allows it (else at niceness 19), maps and populates a spare of the size just needed, so that the next capture
of that size writes into pages that are already there. It uses only CPU time nobody else wants: while the model
evaluates, it waits.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
from typing import Callable

__all__ = ["SPARE_MAPPER"]

MapFn = Callable[[int], mmap.mmap]
Deliver = Callable[[mmap.mmap | None, int], None]


class SpareMapper:
    """Runs ``map(n_bytes)`` for queued requests on one idle-priority daemon thread and hands each result (or
    ``None`` if mapping failed) to the requester's ``deliver(mapping, n_bytes)``."""

    def __init__(self, name: str = "ckpt-spare-pages") -> None:
        self.name = name
        self._queue: queue.SimpleQueue[tuple[MapFn, Deliver, int]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._outstanding = 0
        self._thread: threading.Thread | None = None

    def request(self, map_fn: MapFn, deliver: Deliver, n_bytes: int) -> None:
        """Queue one mapping of ``n_bytes``; returns at once."""
        with self._lock:
            self._outstanding += 1
        self._queue.put((map_fn, deliver, n_bytes))
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()

    def _run(self) -> None:
        _lowest_priority()
        while True:
            map_fn, deliver, n_bytes = self._queue.get()
            try:
                mapping: mmap.mmap | None = map_fn(n_bytes)
            except (OSError, MemoryError):
                mapping = None
            try:
                deliver(mapping, n_bytes)
            finally:
                with self._lock:
                    self._outstanding -= 1
                    if self._outstanding == 0:
                        self._idle.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every queued mapping has been delivered; ``False`` if ``timeout`` seconds passed first.

        For measurements of a steady state: the spares' page faults run on another CPU, but they share the memory
        bus with whatever is being measured.
        """
        with self._lock:
            return self._idle.wait_for(lambda: self._outstanding == 0, timeout)


def _lowest_priority() -> None:
    """Make the calling thread run only on otherwise idle CPUs (Linux: per-thread scheduling)."""
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return
        except OSError:
            pass
    if hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:  # not permitted: the spare is mapped at the process's priority
            pass


SPARE_MAPPER = SpareMapper()
"""The one thread that maps spares for every pool of the process."""
