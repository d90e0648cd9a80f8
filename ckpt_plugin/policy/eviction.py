"""Every eviction rule in one place: which cache entries, disk files and slot checkpoints go, and in what order.

Pure: candidates and sizes in, victims out. The prompt cache (RAM), the disk tier and a slot's checkpoints all ask
here, so a change of eviction policy is one change:

- tiers (RAM entries, disk files): :func:`evict_until` runs the one eviction loop over candidates in least recently
  used order; a ``choose`` callable (the ``select_cache_victims`` hook, which a plugin can implement) picks victims
  for a byte shortfall, :func:`lru_victims` is the rule when nobody does;
- a slot's checkpoints: :func:`checkpoints_to_erase` keeps them spread over the prompt within
  :func:`slot_checkpoint_limit`.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence, TypeVar

from ckpt_plugin.core.checkpoint import Checkpoint

__all__ = [
    "Chooser",
    "SLOT_BUDGET_SHARE",
    "checkpoints_to_erase",
    "evict_until",
    "lru_victims",
    "slot_checkpoint_limit",
]


class Sized(Protocol):
    """What a victim chooser sees of a candidate (a cache entry, a disk-tier record)."""

    @property
    def nbytes(self) -> int: ...


T = TypeVar("T", bound=Sized)

Chooser = Callable[[Sequence[T], int], Sequence[T]]
"""Picks victims among candidates (least recently used first) for a shortfall of bytes (``select_cache_victims``)."""


def lru_victims(candidates: Sequence[T], n_bytes: int) -> list[T]:
    """The least recently used candidates that together free ``n_bytes`` (all of them if they do not)."""
    victims, freed = [], 0
    for candidate in candidates:
        if freed >= n_bytes:
            break
        victims.append(candidate)
        freed += candidate.nbytes
    return victims


def evict_until(
    fits: Callable[[], bool],
    shortfall: Callable[[], int],
    candidates: Callable[[], Sequence[T]],
    remove: Callable[[T], None],
    choose: Chooser[T] | None = None,
) -> tuple[bool, list[T]]:
    """The one eviction loop of every tier: remove victims until ``fits()``; return whether it does and the victims.

    Each round asks ``choose`` (default :func:`lru_victims`) for victims among the current ``candidates()`` for the
    current ``shortfall()``; a victim that is no longer a candidate is skipped (a chooser may name stale objects).
    The loop stops when it fits, or when a round removed nothing (the chooser declined, or nothing is left).

    :param fits: Whether the tier is within its budgets.
    :param shortfall: Bytes over the budget now.
    :param candidates: What may be evicted, least recently used first.
    :param remove: Evicts one candidate.
    :param choose: The victim chooser.
    """
    chooser = choose or lru_victims
    removed: list[T] = []
    while not fits():
        present = candidates()
        held = {id(candidate) for candidate in present}
        progressed = False
        for victim in list(chooser(present, max(0, shortfall()))):
            if id(victim) not in held:
                continue
            held.discard(id(victim))
            remove(victim)
            removed.append(victim)
            progressed = True
            if fits():
                return True, removed
        if not progressed:
            return False, removed
    return True, removed


def checkpoints_to_erase(checkpoints: Sequence[Checkpoint], limit: int) -> list[Checkpoint]:
    """Which checkpoints to drop so that at most ``limit`` remain.

    The newest is always kept; among the others the one closest to its predecessor goes first, so that the kept
    positions stay spread over the prompt (llama.cpp drops the oldest, losing the deep restore points).
    """
    if len(checkpoints) <= limit:
        return []
    kept = list(checkpoints)
    erased: list[Checkpoint] = []
    while len(kept) > max(limit, 0):
        if len(kept) == 1:
            erased.append(kept.pop())
            break
        victim_index, smallest, previous = 0, None, 0
        for index in range(len(kept) - 1):
            gap = kept[index].n_tokens - previous
            previous = kept[index].n_tokens
            if smallest is None or gap < smallest:  # the first smallest gap, as argmin
                victim_index, smallest = index, gap
        erased.append(kept.pop(victim_index))
    return erased


SLOT_BUDGET_SHARE = 2
"""A slot's checkpoints may take at most 1/``SLOT_BUDGET_SHARE`` of the state budget; the rest is the cache's."""


def slot_checkpoint_limit(max_checkpoints: int, budget_bytes: int, checkpoint_bytes: int) -> int:
    """How many checkpoints of ``checkpoint_bytes`` a slot may keep under a byte budget (``budget_bytes`` 0: none).

    The budget bounds every state byte, the slot's too: its checkpoints get half of it, so that a long prompt's
    checkpoints cannot push every cache entry out. The newest checkpoint is always kept (one is what a restore
    inside the slot needs), and with no budget (the cache turned off) only ``max_checkpoints`` applies.
    """
    if budget_bytes <= 0 or checkpoint_bytes <= 0:
        return max_checkpoints
    return max(1, min(max_checkpoints, budget_bytes // SLOT_BUDGET_SHARE // checkpoint_bytes))
