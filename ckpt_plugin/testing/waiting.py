"""Waiting for a condition with a deadline: the deadline only stops a wait that would hang, it measures nothing."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

__all__ = ["wait_until"]

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, *, interval: float = 0.05,
               message: str | Callable[[], str] = "",
               ignore: tuple[type[BaseException], ...] = ()) -> T:
    """Call ``predicate`` every ``interval`` seconds until it returns a true value, and return that value.

    :param timeout: Seconds after which the wait fails: a bound against a hang, to be chosen generously (a slow
        machine must never reach it).
    :param message: What the :class:`TimeoutError` says when the deadline passes (``predicate``'s name if empty); a
        callable is called then (to show the state the wait ended in).
    :param ignore: Exceptions of ``predicate`` that count as "not yet" (a server still starting); any other exception
        ends the wait.
    :raises TimeoutError: ``predicate`` was not true within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except ignore:
            value = None  # type: ignore[assignment]
        if value:
            return value
        if time.monotonic() > deadline:
            said = message() if callable(message) else message
            name = getattr(predicate, "__name__", "the condition")
            raise TimeoutError(said or f"{name} not true within {timeout:g} s")
        time.sleep(interval)
