"""A bounded queue of jobs that one daemon thread runs after the requests that submitted them.

Requests never wait for it: a full queue drops its oldest job (a newer state of the same conversation supersedes
it), counted in :attr:`WriteBehind.drops`. While nothing is queued the thread runs ``idle`` every
``idle_interval`` seconds (the shared tier probes an unreachable server there, off the request path).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

__all__ = ["Job", "WriteBehind"]

log = logging.getLogger("ckpt_plugin")


def _nothing() -> None:
    pass


@dataclass(frozen=True)
class Job:
    """Work to run, and what to release once it ran or was dropped (e.g. the buffers it pinned)."""

    run: Callable[[], None]
    release: Callable[[], None] = _nothing


class WriteBehind:
    """A queue of at most ``max_jobs`` jobs and the thread that runs them in order.

    :param max_jobs: Jobs waiting at most (0: every job is dropped).
    :param idle: Run on the worker thread every ``idle_interval`` seconds while the queue is empty.
    :param name: The thread's name.
    :param nice: CPU priority of the thread (Linux: its own niceness): 19 makes it use only what the model's
        threads leave idle, so a write never slows the request that follows it.
    """

    def __init__(self, max_jobs: int, idle: Callable[[], None] = _nothing, idle_interval: float = 1.0,
                 name: str = "ckpt-write-behind", nice: int = 0) -> None:
        self.max_jobs = max_jobs
        self.idle = idle
        self.idle_interval = idle_interval
        self.nice = nice
        self.drops = 0
        self.done = 0
        self._jobs: deque[Job] = deque()
        self._running = False
        self._closed = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting or running."""
        with self._changed:
            return len(self._jobs) + self._running

    def submit(self, job: Job) -> bool:
        """Queue ``job``; return ``False`` if it was dropped at once (no room at all, or closed)."""
        dropped: Job | None = None
        with self._changed:
            if self._closed or self.max_jobs <= 0:
                self.drops += 1
                dropped = job
            else:
                if len(self._jobs) >= self.max_jobs:
                    dropped = self._jobs.popleft()
                    self.drops += 1
                self._jobs.append(job)
                self._changed.notify_all()
        if dropped is not None:
            dropped.release()
        return dropped is not job

    def drain(self, timeout: float) -> bool:
        """Wait until every queued job ran (at most ``timeout`` seconds); return whether the queue is empty."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._jobs or self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True

    def close(self, timeout: float) -> None:
        """Run what is queued (for at most ``timeout`` seconds), then stop the thread; later jobs are dropped."""
        self.drain(timeout)
        with self._changed:
            self._closed = True
            left, self._jobs = list(self._jobs), deque()
            self.drops += len(left)
            self._changed.notify_all()
        for job in left:
            job.release()

    def _work(self) -> None:
        if self.nice and hasattr(os, "setpriority"):
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            except OSError:  # not permitted, or not per thread on this platform: run at the process's priority
                pass
        while True:
            with self._changed:
                if not self._jobs and not self._closed:
                    self._changed.wait(self.idle_interval)
                if self._closed:
                    return
                job = self._jobs.popleft() if self._jobs else None
                self._running = job is not None
            try:
                if job is None:
                    self.idle()
                else:
                    job.run()
            except Exception:  # a job's failure must not end the thread that runs every later job
                log.exception("write-behind job failed")
            finally:
                if job is not None:
                    job.release()
                with self._changed:
                    self._running = False
                    if job is not None:
                        self.done += 1
                    self._changed.notify_all()
                # The job holds its entry's states: not kept alive while the thread waits for the next one.
                job = None
