"""The one place that builds tiers and shares them: RAM caches by key, disk tiers by directory, shared tiers by
server and options, and the tiers that stand for a host's own cache object.

Sharing is by identity while someone uses a tier: the registry holds tiers weakly (the shared tier excepted, which
lives for the process: its write-behind queue is flushed at exit). Two managers of one process that name the same
disk directory get the same :class:`~ckpt_plugin.tiers.disk.DiskTier`, so one index and one budget govern its files;
two models may share one RAM cache, whose entries stay apart by fingerprint.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, Hashable

from ckpt_plugin.tiers.ram import PromptCache
from ckpt_plugin.tiers.disk import DiskTier

if TYPE_CHECKING:
    from ckpt_plugin.core.config import CheckpointSettings
    from ckpt_plugin.tiers.shared.tier import SharedTier

__all__ = ["TIERS", "TierRegistry"]

log = logging.getLogger("ckpt_plugin")


class TierRegistry:
    """Builds and shares the tiers of one process (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ram: weakref.WeakValueDictionary[Hashable, PromptCache] = weakref.WeakValueDictionary()
        self._disk: weakref.WeakValueDictionary[str, DiskTier] = weakref.WeakValueDictionary()
        self._shared: dict[tuple, SharedTier] = {}
        self._host: weakref.WeakKeyDictionary[Any, tuple[PromptCache, DiskTier | None]] = weakref.WeakKeyDictionary()

    def ram(self, key: Hashable | None, max_bytes: int, max_tokens: int | None = None) -> PromptCache:
        """The RAM cache shared under ``key`` (a new private one for ``None``); built with these budgets on first use.
        """
        if key is None:
            return PromptCache(max_bytes, max_tokens)
        with self._lock:
            cache = self._ram.get(key)
            if cache is None:
                cache = self._ram[key] = PromptCache(max_bytes, max_tokens)
            return cache

    def disk(self, directory: str | os.PathLike[str], max_bytes: int) -> DiskTier:
        """The disk tier of ``directory`` (one per directory in the process); the first caller's budget holds."""
        key = os.path.realpath(directory)
        with self._lock:
            tier = self._disk.get(key)
            if tier is None:
                tier = self._disk[key] = DiskTier(directory, max_bytes)
            elif tier.max_bytes != max_bytes:
                log.warning("disk tier %s is already in use with a budget of %d bytes; %d asked for is ignored", key,
                            tier.max_bytes, max_bytes)
            return tier

    def shared(self, settings: CheckpointSettings) -> SharedTier | None:
        """The process's shared tier for ``settings.redis_url`` and its options (one connection pool and one
        write-behind thread per server and options), or ``None`` without a URL."""
        if settings.redis_url is None:
            return None
        from ckpt_plugin.tiers.shared.tier import SharedTier  # redis-py is an extra: imported only when a URL asks for it

        url = settings.redis_url.get_secret_value()
        key = (url, settings.redis_prefix, settings.redis_ttl, settings.redis_timeout, settings.redis_queue,
               settings.redis_retry)
        with self._lock:
            tier = self._shared.get(key)
            if tier is None:
                tier = self._shared[key] = SharedTier(url, prefix=settings.redis_prefix, ttl=settings.redis_ttl,
                                                      timeout=settings.redis_timeout, queue=settings.redis_queue,
                                                      retry=settings.redis_retry)
                # The lifespan shutdown parks every slot into the queue: write it before the process goes.
                atexit.register(tier.close)
            return tier

    def for_host_cache(self, cache: Any, capacity: int, disk_directory: str | None,
                       settings: CheckpointSettings) -> tuple[PromptCache, DiskTier | None]:
        """The tiers standing for one host cache object, shared by every ``Llama`` given it: a RAM cache of
        ``capacity`` bytes, or with ``disk_directory`` a disk tier of that budget in front of a RAM cache of the
        settings' budget."""
        with self._lock:
            tiers = self._host.get(cache)
        if tiers is None:
            if disk_directory is not None:
                tiers = (self.ram(None, settings.cache_max_bytes, settings.cache_max_tokens),
                         self.disk(disk_directory, capacity))
            else:
                tiers = (self.ram(None, capacity, settings.cache_max_tokens), None)
            with self._lock:
                tiers = self._host.setdefault(cache, tiers)
        return tiers


TIERS = TierRegistry()
"""The process's registry."""
