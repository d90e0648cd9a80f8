"""Prefixes shared between the slots of one KV cache (``ParallelLlama(unified=True)``), and prefixes in flight.

In a unified cache every sequence's cells are in one pool, and ``llama_memory_seq_cp`` adds a sequence to cells
another holds: the cells are then shared, neither copied nor evaluated again. :class:`PrefixSharing` offers each
slot's planner the live memories of the other slots (their published tokens, see
:attr:`~ckpt_plugin.hosts.llama_cpp.sequences.SequenceBackend.published`) as
:class:`~ckpt_plugin.engine.slot_memory.CellSource` candidates: sixteen conversations with one long system prompt
hold it once per pool instead of once per slot.

Prefixes in flight: requests that arrive together with the same new prefix would each evaluate it. A generation
whose prompt shares with another slot's prompt in flight (being evaluated) at least ``min_tokens`` more than any
memory holds now waits for that slot's evaluation to publish them, then shares its cells. The waits form no cycle:
a generation waits only for a flight registered before its own.

Only for memory kinds whose cells sequences can share (:func:`~ckpt_plugin.policy.plan.shares_cells`: plain
attention); for the others the slots keep their memories to themselves, as with a KV stream each.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from ckpt_plugin.core.checkpoint import Checkpoint
from ckpt_plugin.core.counters import Counters
from ckpt_plugin.core.request import current_request
from ckpt_plugin.core.slot import Backend
from ckpt_plugin.hosts.llama_cpp.sequences import SequenceBackend
from ckpt_plugin.policy.plan import common_prefix, keep_limit

_RECHECK_SECONDS = 0.5
"""How often a waiting generation looks again without being woken (its client may have left)."""


@dataclass(frozen=True)
class LivePrefix:
    """Another sequence's published tokens, as a planner candidate (:class:`~ckpt_plugin.engine.slot_memory.CellSource`).

    :ivar tokens: What its cells hold from position 0.
    :ivar source: The sequence.
    """

    tokens: np.ndarray
    source: SequenceBackend

    @property
    def n_tokens(self) -> int:
        """Every published token is held."""
        return len(self.tokens)

    @property
    def pos_min(self) -> int:
        """Plain attention: the cells reach back to position 0."""
        return 0

    @property
    def checkpoints(self) -> Sequence[Checkpoint]:
        """None: the cells themselves are shared."""
        return ()

    def share_into(self, backend: Backend, n_keep: int) -> bool:
        """Make ``backend`` (a sequence of the same context) hold these cells' first ``n_keep``; ``False`` if the
        source no longer holds them."""
        if not isinstance(backend, SequenceBackend) or backend.context is not self.source.context:
            return False
        return backend.share_prefix(self.source, self.tokens, n_keep)


@dataclass(frozen=True)
class _Flight:
    """A generation evaluating its prompt on a slot."""

    slot_id: int
    namespace: str
    prompt: np.ndarray


class PrefixSharing:
    """The cells the slots of one unified KV cache share, and the prompts in flight (see the module docstring).

    :param backends: The slots' sequences, by slot id.
    :param counters: The engine's counters (``prefix_waits``).
    :param min_tokens: The fewest tokens a flight must offer beyond what memory holds now to be waited for.
    """

    def __init__(self, backends: Sequence[SequenceBackend], counters: Counters, min_tokens: int) -> None:
        self.backends = list(backends)
        self.counters = counters
        self.min_tokens = min_tokens
        self._cond = threading.Condition()
        self._flights: dict[int, _Flight] = {}
        self._waiting = 0
        for backend in self.backends:
            backend.on_publish = self._published

    def peers(self, slot_id: int) -> Callable[[str], list[LivePrefix]]:
        """The other slots' live memories in a namespace, for slot ``slot_id``'s planner."""

        def offered(namespace: str) -> list[LivePrefix]:
            found = []
            for backend in self.backends:
                published = backend.published
                if backend.seq_id != slot_id and published is not None and published[0] == namespace:
                    found.append(LivePrefix(published[1], backend))
            return found

        return offered

    def _published(self) -> None:
        if self._waiting:  # read without the lock: a waiter looks again at least every _RECHECK_SECONDS
            with self._cond:
                self._cond.notify_all()

    def _held(self, namespace: str, prompt: np.ndarray) -> int:
        """The longest prefix of ``prompt`` some slot's cells hold now."""
        held = 0
        for backend in self.backends:
            published = backend.published
            if published is not None and published[0] == namespace:
                held = max(held, common_prefix(published[1], prompt))
        return held

    @contextlib.contextmanager
    def flight(self, slot_id: int, namespace: str, prompt: np.ndarray) -> Iterator[None]:
        """Register the generation of ``prompt`` on ``slot_id`` as in flight while the block runs; first, if another
        flight will give more of ``prompt`` than any memory holds now (by ``min_tokens`` at least), wait until it
        has (or has ended). No lock is held while waiting, nor when the block runs."""
        limit = keep_limit(len(prompt))
        with self._cond:
            held = min(self._held(namespace, prompt), limit)
            leader, target = None, held + self.min_tokens
            for other in self._flights.values():
                if other.namespace == namespace:
                    offers = min(common_prefix(other.prompt, prompt), limit)
                    if offers >= target:
                        leader, target = other, offers
            flight = _Flight(slot_id, namespace, prompt)
            self._flights[slot_id] = flight
            if leader is not None:
                self.counters.add(prefix_waits=1)
                self._wait_for(leader, target)
        try:
            yield
        finally:
            with self._cond:
                if self._flights.get(slot_id) is flight:
                    del self._flights[slot_id]
                self._cond.notify_all()

    def _wait_for(self, leader: _Flight, target: int) -> None:
        # The condition is held (released while waiting).
        scope = current_request.get()
        source = self.backends[leader.slot_id]
        self._waiting += 1
        try:
            while self._flights.get(leader.slot_id) is leader:
                published = source.published
                if published is not None and common_prefix(published[1], leader.prompt) >= target:
                    return
                if scope is not None and scope.interrupted():
                    return
                self._cond.wait(_RECHECK_SECONDS)
        finally:
            self._waiting -= 1
