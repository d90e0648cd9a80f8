"""The host's own prompt-cache interface over the engine's store: ``save_state`` / ``load_state`` handles that share
states instead of copying them, and a ``BaseLlamaCache`` view of the prefix-indexed cache."""

from __future__ import annotations

import functools

import os
from typing import Sequence

import numpy as np
from llama_cpp.llama import Llama, LlamaState
from llama_cpp.llama_cache import BaseLlamaCache, LlamaDiskCache

from ckpt_plugin.hosts.llama_cpp.seam import compat as host
from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.tiers.ram import PromptCache
from ckpt_plugin.core.checkpoint import freeze
from ckpt_plugin.core.config import CheckpointSettings
from ckpt_plugin.tiers.disk import DiskTier
from ckpt_plugin.engine.manager import CheckpointManager
from ckpt_plugin.tiers.registry import TIERS

__all__ = ["HostPromptCache", "SharedLlamaState", "host_only_known", "mark_host_only", "tiers_for_host_cache"]

_NO_SCORES = freeze(np.empty((0, 0), dtype=np.single))


class SharedLlamaState(LlamaState):
    """A ``LlamaState`` that references an immutable prompt-cache entry instead of copying the state.

    ``llama_state`` is a read-only ``memoryview`` of the captured bytes (a paged state's pages are assembled the
    first time it is read: restoring through the manager never reads it); ``scores`` is empty because restoring
    always re-evaluates the last prompt token (fresh logits). Pickling it produces a plain ``LlamaState`` copy.
    """

    def __init__(self, entry: CacheEntry, seed: int) -> None:
        self.entry = entry
        self.input_ids = entry.tokens
        self.scores = _NO_SCORES
        self.n_tokens = entry.n_tokens
        self.llama_state_size = int(entry.state.target.nbytes)
        self.seed = seed

    @functools.cached_property
    def llama_state(self) -> memoryview:  # type: ignore[override]
        return memoryview(self.entry.state.target_bytes())

    def __reduce__(self) -> tuple:
        raise TypeError(
            "SharedLlamaState references a live sequence-state capture and cannot be pickled; "
            "use the manager's persistence API to store it"
        )


_HOST_ONLY = "_ckpt_plugin_known_tokens"


def mark_host_only(state: LlamaState, known: int) -> LlamaState:
    """Mark a state the host saved itself while its memory held positions no token id names, of which the first
    ``known`` tokens are named: the cache keeps it out, ``load_state`` restores it as the host would."""
    setattr(state, _HOST_ONLY, known)
    return state


def host_only_known(state: LlamaState) -> int | None:
    """For a state marked by :func:`mark_host_only`, the tokens it names; ``None`` for any other state."""
    known = getattr(state, _HOST_ONLY, None)
    return None if known is None else int(known)


class HostPromptCache(BaseLlamaCache):
    """``BaseLlamaCache`` interface over a manager's prompt cache, installed by the patched ``set_cache``."""

    def __init__(self, manager: CheckpointManager, llama: Llama) -> None:
        super().__init__(manager.cache.max_bytes)
        self.manager = manager
        self._llama = llama

    def __bool__(self) -> bool:
        return True

    @property
    def cache_size(self) -> int:
        return self.manager.cache.resident_bytes

    def _best(self, key: Sequence[int]) -> CacheEntry | None:
        # The host takes one state: the entries below the point where the prompt leaves the tree all share the same
        # prefix with it, so one of them is as good as any (no walk through the others' subtrees).
        candidates = self.manager.cache.lookup(self.manager.primary.current_namespace(), self.manager.fingerprint, key,
                                               max_candidates=1)
        best = max(candidates, key=lambda pair: pair[1], default=None)
        return best[0] if best is not None and best[1] > 0 else None

    def __getitem__(self, key: Sequence[int]) -> LlamaState:
        entry = self._best(key)
        if entry is None:
            raise KeyError("no cached prompt shares a prefix with this key")
        return SharedLlamaState(entry, host.seed(self._llama))

    def __contains__(self, key: Sequence[int]) -> bool:
        return self._best(key) is not None

    def __setitem__(self, key: Sequence[int], value: LlamaState) -> None:
        if host_only_known(value) is not None:
            return  # its key names positions the memory does not hold as those tokens: never cached
        if not isinstance(value, SharedLlamaState):
            raise TypeError("only states from an attached Llama's save_state() can be cached here")
        with self.manager.primary.lock:
            self.manager.admit(value.entry)


def tiers_for_host_cache(
    cache: BaseLlamaCache, settings: CheckpointSettings
) -> tuple[PromptCache, DiskTier | None]:
    """The prompt cache (and disk tier) standing for one host cache object, shared by every ``Llama`` given it.

    ``LlamaRAMCache(capacity_bytes)`` becomes a RAM prompt cache of that budget; ``LlamaDiskCache(cache_dir,
    capacity_bytes)`` a disk tier in ``cache_dir`` of that budget, in front of a RAM cache of the manager's budget.
    Entries of different models stay apart through their fingerprints, as in the host's own cache.
    """
    capacity = int(getattr(cache, "capacity_bytes", settings.cache_max_bytes))
    directory = os.path.join(cache.cache.directory, "ckpt_plugin") if isinstance(cache, LlamaDiskCache) else None
    return TIERS.for_host_cache(cache, capacity, directory, settings)
