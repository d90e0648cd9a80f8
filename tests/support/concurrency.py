"""Starting test calls together."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable


def all_at_once(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run ``calls`` concurrently, started together; re-raise the first failure."""
    barrier = threading.Barrier(len(calls))

    def run(call: Callable[[], Any]) -> Any:
        barrier.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))
