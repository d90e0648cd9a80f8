"""Which slot serves a request, and the leases that keep one request per slot.

A request goes to the idle slot whose live memory shares the longest prefix with its prompt, in the request's own
namespace (a tenant never lands on another's live state as a prefix); without any shared prefix, to the least
recently used idle slot, whose state the engine parks in the cache before it serves the new prompt
(:meth:`~ckpt_plugin.engine.slot_controller.SlotController.prepare`). This is llama.cpp's server's slot choice (prompt
similarity, then LRU).

:func:`choose_slot` is pure; :class:`SlotLeases` applies it under a lock and marks the chosen slot busy.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ckpt_plugin.core.memory import common_prefix

__all__ = ["IdleSlot", "SlotLeases", "choose_slot"]


@dataclass(frozen=True)
class IdleSlot:
    """What the choice reads of an idle slot.

    :ivar slot_id: The slot.
    :ivar namespace: The namespace of its live state.
    :ivar tokens: The tokens its memory holds.
    :ivar last_used: When it was last leased (a counter; smaller is older).
    """

    slot_id: int
    namespace: str
    tokens: np.ndarray
    last_used: int


def choose_slot(prompt: np.ndarray, namespace: str, idle: Sequence[IdleSlot]) -> int:
    """The idle slot for ``prompt`` of ``namespace``: the longest shared prefix, else the least recently used.

    Ties on the prefix go to the least recently used slot.

    :raises ValueError: ``idle`` is empty.
    """
    if not idle:
        raise ValueError("no idle slot to choose from")

    def shared(slot: IdleSlot) -> int:
        return common_prefix(slot.tokens, prompt) if slot.namespace == namespace else 0

    return min(idle, key=lambda slot: (-shared(slot), slot.last_used)).slot_id


class SlotLeases:
    """One request per slot at a time: :meth:`lease` waits for an idle slot and chooses it by :func:`choose_slot`.

    :param n_slots: Slots ``0..n_slots-1``.
    :param describe: The ``(namespace, tokens)`` of a slot's live memory (read while no request holds it).
    """

    def __init__(self, n_slots: int, describe: Callable[[int], tuple[str, np.ndarray]]) -> None:
        self.n_slots = n_slots
        self._describe = describe
        self._busy = [False] * n_slots
        self._last_used = [0] * n_slots
        self._clock = itertools.count(1)
        self._cond = threading.Condition()

    def busy(self, slot_id: int) -> bool:
        """Whether a request holds ``slot_id`` now."""
        return self._busy[slot_id]

    def lease(self, prompt: np.ndarray, namespace: str) -> int:
        """Wait for an idle slot, choose one for ``prompt`` and mark it busy; return its id."""
        with self._cond:
            while all(self._busy):
                self._cond.wait()
            idle = []
            for slot_id in range(self.n_slots):
                if not self._busy[slot_id]:
                    slot_namespace, tokens = self._describe(slot_id)
                    idle.append(IdleSlot(slot_id, slot_namespace, tokens, self._last_used[slot_id]))
            slot_id = choose_slot(prompt, namespace, idle)
            self._busy[slot_id] = True
            self._last_used[slot_id] = next(self._clock)
            return slot_id

    def idle_oldest_first(self) -> list[int]:
        """The slots no request holds now, least recently used first (a snapshot: one may be leased meanwhile)."""
        with self._cond:
            idle = [slot_id for slot_id in range(self.n_slots) if not self._busy[slot_id]]
            return sorted(idle, key=lambda slot_id: self._last_used[slot_id])

    def release(self, slot_id: int) -> None:
        """The request holding ``slot_id`` is done with it."""
        with self._cond:
            self._busy[slot_id] = False
            self._cond.notify()
