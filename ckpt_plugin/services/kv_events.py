"""KV events in vLLM's wire format, from what the page store tells: which events, and their bytes.

vLLM publishes a ``KVEventBatch`` for each engine step: ``[ts, events, data_parallel_rank]`` (a msgpack array),
each event a msgpack map tagged by ``"type"`` (vLLM >= 0.26; vllm/distributed/kv_events.py):

- ``BlockStored``: ``block_hashes`` (consecutive blocks of one chain), ``parent_block_hash`` (the block before the
  first, ``None`` at the start of a sequence), ``token_ids`` (``block_size`` per block), ``block_size``, ``lora_id``,
  ``medium``, ``lora_name``, ``group_idx``;
- ``BlockRemoved``: ``block_hashes``, ``medium``, ``group_idx``;
- ``AllBlocksCleared``.

Here a block is a **whole page** (:class:`~ckpt_plugin.core.pages.PageInfo`): ``page_positions`` positions of one
attention cache starting on a multiple of it. A page that is not whole (a prompt's last, partly filled page; the first
page of a window cache, which starts inside a page) is not announced: vLLM announces full blocks only, and consumers
that hash ``token_ids`` by ``block_size`` (Dynamo, llm-d) skip or refuse a short one.

- **Hashes**: a page's id is 16 bytes; vLLM sends an int by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: the
  low 64 bits of the digest, ``int.from_bytes(digest, "big") & (2**64 - 1)``), which is what the consumers index by;
  with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` the whole id is sent as bytes, as vLLM then sends its digest.
- **Media**: a page live in this process (held by a slot's checkpoints or the RAM prompt cache) is ``"CPU"``
  (vLLM's name for host memory: a restore copies it into the context); a page this replica wrote to the shared tier
  is ``"STORAGE"`` with ``"locality": "REMOTE"`` (a store outside the replica, which every replica reads); the disk
  tier, which keeps states whole, announces none.
- **Groups**: ``group_idx`` is the page's cache counted from the last (0 for most models; an iSWA model's window
  cache 0, its full cache 1), as vLLM numbers its KV cache groups.
- **Tenants** are folded into the page ids (the seed of every id is the model's fingerprint and the namespace), as
  vLLM folds a request's ``cache_salt`` into its block hashes.

:class:`KvEventTracker` turns the store's notifications, in order, into events: a page is announced once per medium
while it lives there, its going is announced once, and nothing is announced for a page the consumer was never told
of. It is pure (no sockets, no threads); :mod:`ckpt_plugin.services.kv_publisher` runs it on a thread of its own.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Iterable, Sequence

import msgspec

from ckpt_plugin.core.pages import PageInfo

__all__ = [
    "LOCALITY",
    "MEDIUM",
    "KvEventTracker",
    "block_hash",
    "encode_batch",
    "int_block_hashes",
]

MEDIUM = {"ram": "CPU", "disk": "DISK", "shared": "STORAGE"}
"""The ``medium`` of each tier's events."""
LOCALITY = {"shared": "REMOTE"}
"""The ``locality`` of the tiers outside the replica (vLLM: ``LOCAL`` or ``REMOTE`` relative to the publisher)."""
MAX_TIER_PAGES = 1 << 20
"""Pages of a tier outside the process remembered as announced (the oldest are forgotten past it)."""

_ENCODER = msgspec.msgpack.Encoder()


def int_block_hashes() -> bool:
    """Whether block hashes are sent as ints: vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (default 1)."""
    return os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1").strip() not in ("0", "false", "False")


def block_hash(page_id: bytes, as_int: bool = True) -> int | bytes:
    """A page's id as a block hash: its low 64 bits as an int (vLLM's default), or the id itself."""
    return int.from_bytes(page_id[-8:], "big") if as_int else page_id


def encode_batch(ts: float, events: Sequence[dict[str, Any]], data_parallel_rank: int = 0) -> bytes:
    """The msgpack payload of a ``KVEventBatch``: ``[ts, events, data_parallel_rank]``."""
    return _ENCODER.encode([ts, list(events), data_parallel_rank])


class KvEventTracker:
    """The page store's notifications, in the order they happened, as vLLM's events.

    :param as_int: Block hashes as ints (vLLM's default) or bytes.
    :ivar not_whole: Pages not announced because they do not cover a whole block.
    :ivar unknown: Pages a tier wrote that were not live and announced here (nothing to say of their tokens).
    """

    def __init__(self, as_int: bool = True) -> None:
        self.as_int = as_int
        # The announced pages live in this process: id -> (the announcement's token, what the page holds).
        self._live: dict[bytes, tuple[int, PageInfo]] = {}
        # The announced pages of each tier outside the process: id -> (namespace, group).
        self._tiers: dict[str, OrderedDict[bytes, tuple[str, int]]] = {}
        self._events: list[dict[str, Any]] = []
        self.not_whole = 0
        self.unknown = 0

    def __len__(self) -> int:
        """Pages announced and not gone, over every medium."""
        return len(self._live) + sum(len(pages) for pages in self._tiers.values())

    # ------------------------------------------------------------------------------------------------------------
    # notifications (PageListener's, in order)

    def stored(self, info: PageInfo, token: int) -> None:
        """A page became live (announcement ``token``)."""
        if not info.whole:
            self.not_whole += 1
            return
        known = info.page_id in self._live
        self._live[info.page_id] = (token, info)
        if not known:  # a new page object of an id still announced (its last one is going): nothing changed
            self._stored("ram", info)

    def gone(self, page_id: bytes, token: int) -> None:
        """The page of announcement ``token`` was freed."""
        live = self._live.get(page_id)
        if live is not None and live[0] == token:
            del self._live[page_id]
            self._removed("ram", page_id, live[1].depth)

    def tier_stored(self, tier: str, page_ids: Iterable[bytes]) -> None:
        """Tier ``tier`` wrote ``page_ids``."""
        pages = self._tiers.setdefault(tier, OrderedDict())
        for page_id in page_ids:
            live = self._live.get(page_id)
            if live is None:
                self.unknown += 1
                continue
            info = live[1]
            if page_id in pages:
                pages.move_to_end(page_id)
                continue
            pages[page_id] = (info.namespace, info.depth)
            if len(pages) > MAX_TIER_PAGES:
                pages.popitem(last=False)
            self._stored(tier, info)

    def cleared(self, namespace: str | None) -> None:
        """Every tier forgot ``namespace`` (everything, for ``None``): ``AllBlocksCleared``, or the removal of that
        namespace's pages of the tiers outside the process (its live pages are announced as they go)."""
        if namespace is None:
            self._live.clear()
            self._tiers.clear()
            self._events.append({"type": "AllBlocksCleared"})
            return
        for tier, pages in self._tiers.items():
            for page_id, (owner, group) in list(pages.items()):
                if owner == namespace:
                    del pages[page_id]
                    self._removed(tier, page_id, group)

    def apply(self, notification: tuple[Any, ...]) -> None:
        """One notification as :mod:`ckpt_plugin.services.kv_publisher` queues them: ``(verb, *arguments)``."""
        verb, *arguments = notification
        getattr(self, verb)(*arguments)

    def take(self) -> list[dict[str, Any]]:
        """The events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------------------------------------------------
    # events

    def _stored(self, tier: str, info: PageInfo) -> None:
        digest = block_hash(info.page_id, self.as_int)
        parent = None if info.parent_id is None else block_hash(info.parent_id, self.as_int)
        last = self._events[-1] if self._events else None
        # The pages of one capture come in position order: one event per chain, as vLLM sends a request's blocks.
        if (last is not None and last["type"] == "BlockStored" and last["medium"] == MEDIUM[tier]
                and last["group_idx"] == info.depth and last.get("locality") == LOCALITY.get(tier)
                and last["block_size"] == info.page_positions and parent is not None
                and last["block_hashes"][-1] == parent):
            last["block_hashes"].append(digest)
            last["token_ids"].extend(info.tokens.tolist())
            return
        event: dict[str, Any] = {
            "type": "BlockStored", "block_hashes": [digest], "parent_block_hash": parent,
            "token_ids": info.tokens.tolist(), "block_size": info.page_positions, "lora_id": None,
            "medium": MEDIUM[tier], "lora_name": None, "group_idx": info.depth,
        }
        if tier in LOCALITY:
            event["locality"] = LOCALITY[tier]
        self._events.append(event)

    def _removed(self, tier: str, page_id: bytes, group: int) -> None:
        digest = block_hash(page_id, self.as_int)
        last = self._events[-1] if self._events else None
        if (last is not None and last["type"] == "BlockRemoved" and last["medium"] == MEDIUM[tier]
                and last["group_idx"] == group and last.get("locality") == LOCALITY.get(tier)):
            last["block_hashes"].append(digest)
            return
        event: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": [digest], "medium": MEDIUM[tier],
                                 "group_idx": group}
        if tier in LOCALITY:
            event["locality"] = LOCALITY[tier]
        self._events.append(event)
