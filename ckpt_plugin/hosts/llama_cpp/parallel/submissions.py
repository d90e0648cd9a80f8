"""What a slot's thread hands the batch scheduler: its submission of tokens, and what runs with it.

A slot's thread may register callbacks for its next submission (:func:`at_next_step`): they run when that
submission goes into a step, just before the step's decode. A thread may hold locks until its next submission is
queued (:func:`held_until_submitted`;
:meth:`~ckpt_plugin.hosts.llama_cpp.parallel.scheduler.BatchScheduler.held_until_submitted` takes them). The lanes
(:mod:`ckpt_plugin.hosts.llama_cpp.parallel.lanes`) queue and decode the submissions.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Callable, Iterator

import numpy as np

__all__ = ["Submission", "at_next_step", "decoding", "held_until_submitted", "release_hold", "run_callbacks",
           "take_callbacks"]

log = logging.getLogger("ckpt_plugin")

_next_step = threading.local()
_decoding: set[int] = set()  # the schedulers in llama_decode now (set.add and discard are atomic)


def at_next_step(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the calling thread's next submission goes into a step, just before that step's decode.

    For work a slot's thread hands to other threads (a streamed chunk for the event loop to send): done then, it
    runs while llama.cpp computes, instead of between two steps, where every slot's own Python work is on the path
    to the next step. While a step is being decoded the callback runs at once: the next step would start only
    after it (a long prompt chunk can take most of a second). A callback that raises is logged and ignored.
    """
    if _decoding:
        run_callbacks([callback])
        return
    callbacks = getattr(_next_step, "callbacks", None)
    if callbacks is None:
        callbacks = _next_step.callbacks = []
    callbacks.append(callback)


class _Hold:
    """The locks a thread holds until its next submission is queued (see :func:`held_until_submitted`)."""

    __slots__ = ("locks", "held")

    def __init__(self, locks: tuple[threading.RLock, ...]) -> None:
        self.locks = locks
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            for lock in reversed(self.locks):
                lock.release()


def release_hold() -> None:
    """Let go of the calling thread's hold (:func:`held_until_submitted`), if it still has one:
    before anything that may wait on other code without a submission to release it."""
    hold = getattr(_next_step, "hold", None)
    if hold is not None:
        _next_step.hold = None
        hold.release()


def run_callbacks(callbacks: list[Callable[[], None]]) -> None:
    """Run ``callbacks`` in order; one that raises is logged and the others still run."""
    for callback in callbacks:
        try:
            callback()
        except Exception:
            log.exception("a callback run at a batched step failed")


class Submission:
    """Tokens of one slot waiting for evaluation, with the logits rows it asked for."""

    __slots__ = ("seq_id", "tokens", "positions", "flags", "outputs", "taken", "rows", "done", "error", "at_step",
                 "pos_min", "extend", "drafted")

    def __init__(self, seq_id: int, tokens: np.ndarray, n_past: int, first: int, n_vocab: int,
                 extend: int = 0) -> None:
        n = len(tokens)
        self.seq_id = seq_id
        self.tokens = tokens
        self.positions = np.arange(n_past, n_past + n, dtype=np.int32)
        self.flags = np.zeros(n, dtype=np.int8)
        self.flags[min(first, n - 1):] = 1
        self.outputs = np.empty((n - min(first, n - 1), n_vocab), dtype=np.single)
        self.taken = 0  # tokens already placed in a step
        self.rows = 0  # output rows already filled
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.at_step: list[Callable[[], None]] | None = None
        self.pos_min: int | None = None  # the sequence's smallest position after its last chunk's step
        self.extend = extend  # greedy tokens still to draft after the last token
        self.drafted: list[int] = []

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.taken

    def draft_next(self) -> bool:
        """After the submission's last token was decoded: take the greedy token of its last row; return whether
        that token is evaluated next (more tokens to draft), the submission then holding only it."""
        row = self.outputs[self.rows - 1]
        token = int(np.argmax(row))
        self.drafted.append(token)
        self.extend -= 1
        if self.extend <= 0:
            return False
        position = int(self.positions[-1]) + 1
        self.tokens = np.array([token], dtype=np.int32)
        self.positions = np.array([position], dtype=np.int32)
        self.flags = np.ones(1, dtype=np.int8)
        self.outputs = self.outputs[-1:]
        self.taken = self.rows = 0
        return True


def take_callbacks() -> list[Callable[[], None]] | None:
    """The callbacks the calling thread registered for its next submission (:func:`at_next_step`), taken: the
    submission being made now runs them."""
    callbacks, _next_step.callbacks = getattr(_next_step, "callbacks", None), None
    return callbacks


@contextlib.contextmanager
def held_until_submitted(locks: tuple[threading.RLock, ...]) -> Iterator[None]:
    """Keep ``locks`` (acquired by the caller) until the calling thread's next submission is queued
    (:func:`release_hold`), or the block ends."""
    hold = _Hold(locks)
    _next_step.hold = hold
    try:
        yield
    finally:
        if getattr(_next_step, "hold", None) is hold:
            _next_step.hold = None
        hold.release()


@contextlib.contextmanager
def decoding(scheduler: object) -> Iterator[None]:
    """Mark ``scheduler`` as in ``llama_decode`` while the block runs: :func:`at_next_step` then runs a callback at
    once."""
    _decoding.add(id(scheduler))
    try:
        yield
    finally:
        _decoding.discard(id(scheduler))
