"""Prefixes shared between the slots of one KV cache (``ParallelLlama(unified=True)``), and prefixes in flight.

In a unified cache every sequence's cells are in one pool, and ``llama_memory_seq_cp`` adds a sequence to cells
another holds: the cells are then shared, neither copied nor evaluated again. :class:`PrefixSharing` offers each
slot's planner the live memories of the other slots (the tokens their cells offer, see
:attr:`~ckpt_plugin.hosts.llama_cpp.parallel.sequences.SequenceBackend.offered`) as
:class:`~ckpt_plugin.engine.slot_memory.CellSource` candidates: sixteen conversations with one long system prompt
hold it once per pool instead of once per slot.

Cells are shared only for memory kinds that allow it (:func:`~ckpt_plugin.policy.plan.shares_cells`: plain
attention); for the others, and with a KV stream per slot, each slot keeps its cells to itself.

Prefixes in flight: requests that arrive together with the same new prefix would each evaluate it. A generation
whose prompt shares with another slot's prompt in flight (being evaluated) at least ``min_tokens`` more than any
memory it could share holds now waits until that slot has evaluated them, then shares its cells; where cells are not
shared, that slot parks its state in the cache once it holds them (``park``, on its own thread) and the waiters
restore it from there: a copy, still far cheaper than evaluating. Not for recurrent states, which serve no prefix
shorter than their end. The waits form no cycle: a generation waits only for a flight registered before its own.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from ckpt_plugin.core.checkpoint import Checkpoint
from ckpt_plugin.core.counters import Counters
from ckpt_plugin.core.request import current_request
from ckpt_plugin.core.slot import Backend
from ckpt_plugin.hosts.llama_cpp.parallel.sequences import SequenceBackend
from ckpt_plugin.core.memory import common_prefix
from ckpt_plugin.policy.plan import keep_limit

__all__ = ["PrefixSharing"]

_RECHECK_SECONDS = 0.5
"""How often a waiting generation looks again without being woken (its client may have left)."""


@dataclass(frozen=True)
class LivePrefix:
    """The tokens another sequence's cells offer, as a planner candidate
    (:class:`~ckpt_plugin.engine.slot_memory.CellSource`).

    :ivar tokens: What its cells hold from position 0.
    :ivar source: The sequence.
    """

    tokens: np.ndarray
    source: SequenceBackend

    @property
    def n_tokens(self) -> int:
        """Every offered token is held."""
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


class _Flight:
    """A generation evaluating its prompt on a slot, and what of the prompt the others can take from it."""

    __slots__ = ("slot_id", "namespace", "prompt", "wanted", "ready")

    def __init__(self, slot_id: int, namespace: str, prompt: np.ndarray) -> None:
        self.slot_id = slot_id
        self.namespace = namespace
        self.prompt = prompt
        self.wanted = 0  # the longest prefix a waiter waits for
        self.ready = 0  # the longest prefix parked in the cache for the waiters (without shared cells)


class PrefixSharing:
    """The prompts in flight, and the cells the slots of one unified KV cache share (see the module docstring).

    :param backends: The slots' sequences, by slot id.
    :param counters: The engine's counters (``prefix_waits``).
    :param min_tokens: The fewest tokens a flight must offer beyond what memory holds now to be waited for.
    :param park: Without shared cells: puts a slot's state into the cache (its argument), where the waiters find
        it; ``None``: the waiters share the slot's cells (a unified cache, plain attention).
    """

    def __init__(self, backends: Sequence[SequenceBackend], counters: Counters, min_tokens: int,
                 park: Callable[[int], object] | None = None) -> None:
        self.backends = list(backends)
        self.counters = counters
        self.min_tokens = min_tokens
        self.park = park
        self._cond = threading.Condition()
        self._flights: dict[int, _Flight] = {}
        self._waiting = 0
        for backend in self.backends:
            backend.on_offer = functools.partial(self._offered, backend.seq_id)

    def peers(self, slot_id: int) -> Callable[[str], list[LivePrefix]]:
        """The other slots' live memories in a namespace, for slot ``slot_id``'s planner."""

        def live_prefixes(namespace: str) -> list[LivePrefix]:
            found = []
            for backend in self.backends:
                offered = backend.offered
                if backend.seq_id != slot_id and offered is not None and offered[0] == namespace:
                    found.append(LivePrefix(offered[1], backend))
            return found

        return live_prefixes

    def _evaluated(self, flight: _Flight) -> int:
        """How much of ``flight``'s prompt its slot's cells hold now."""
        offered = self.backends[flight.slot_id].offered
        return common_prefix(offered[1], flight.prompt) if offered is not None else 0

    def _offered(self, slot_id: int) -> None:
        """Slot ``slot_id`` offered what its cells hold (on its own thread): wake the waiters; without shared
        cells, first park its state for them once it holds what they wait for."""
        if not self._waiting:  # read without the lock: a waiter looks again at least every _RECHECK_SECONDS
            return
        with self._cond:
            flight = self._flights.get(slot_id)
            evaluated = self._evaluated(flight) if flight is not None else 0
            parking = (self.park is not None and flight is not None and flight.ready < flight.wanted <= evaluated)
            if not parking:
                self._cond.notify_all()
                return
        self.park(slot_id)  # type: ignore[misc]  # a state capture: outside the lock
        with self._cond:
            flight.ready = evaluated  # type: ignore[union-attr]  # parked or not: the waiters go on
            self._cond.notify_all()

    def _held(self, namespace: str, prompt: np.ndarray) -> int:
        """The longest prefix of ``prompt`` some slot's cells hold now, for them to share (0 without sharing)."""
        held = 0
        for backend in self.backends if self.park is None else ():
            offered = backend.offered
            if offered is not None and offered[0] == namespace:
                held = max(held, common_prefix(offered[1], prompt))
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
                leader.wanted = max(leader.wanted, target)
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
        self._waiting += 1
        try:
            while self._flights.get(leader.slot_id) is leader:
                ready = self._evaluated(leader) if self.park is None else leader.ready
                if ready >= target:
                    return
                if scope is not None and scope.interrupted():
                    return
                self._cond.wait(_RECHECK_SECONDS)
        finally:
            self._waiting -= 1
