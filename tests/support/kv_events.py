"""A KV events consumer for the tests: a real ZeroMQ SUB socket and replay requests, batches decoded with vLLM's
event definitions, and the index a router keeps from them.

The definitions are vLLM 0.34.0's (vllm/distributed/kv_events.py: ``EventBatch``, ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``, ``KVEventBatch``), written out here field for field and in their order, with
their msgspec options (the batch an array, each event a map tagged by ``type``, defaults omitted): vLLM itself does
not import without its whole runtime (torch among it), so its classes cannot be used as they are; a typed decoder of
these definitions refuses a payload that vLLM's own would refuse (a missing field, a wrong type).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Union

import msgspec
import zmq

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "Consumer", "Index", "KVEventBatch"]

ExternalBlockHash = Union[bytes, int]
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: Union[int, None] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base class for all KV cache-related events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: Union[ExternalBlockHash, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None]
    lora_name: Union[str, None]
    extra_keys: Union[list[Union[tuple[Any, ...], None]], None] = None
    group_idx: Union[int, None] = None
    kv_cache_spec_kind: Union[str, None] = None
    kv_cache_spec_sliding_window: Union[int, None] = None
    locality: Union[str, None] = None
    ownership: Union[str, None] = None
    session_id: Union[str, None] = None
    lookahead_token_ids: Union[list[list[int]], None] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: Union[str, None]
    group_idx: Union[int, None] = None
    locality: Union[str, None] = None
    ownership: Union[str, None] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


@dataclass
class Index:
    """What a consumer knows of one replica from its events, checked as it goes: a block is announced once per
    medium while it is there, and only a block announced is removed.

    :ivar live: ``(medium, hash) -> the token ids from position 0 to the block's end`` (the chain of its parents).
    :ivar stored: Every ``(medium, hash)`` ever announced.
    """

    live: dict[tuple[str | None, Any], list[int]] = field(default_factory=dict)
    stored: set[tuple[str | None, Any]] = field(default_factory=set)
    prefixes: dict[Any, list[int]] = field(default_factory=dict)
    removed: int = 0
    clears: int = 0

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.live.clear()
                self.clears += 1
            elif isinstance(event, BlockStored):
                assert len(event.token_ids) == event.block_size * len(event.block_hashes), event
                parent = event.parent_block_hash
                prefix = [] if parent is None else self.prefixes.get(parent)
                for i, digest in enumerate(event.block_hashes):
                    key = (event.medium, digest)
                    assert key not in self.live, f"announced twice: {key}"
                    tokens = event.token_ids[i * event.block_size:(i + 1) * event.block_size]
                    if prefix is not None:
                        prefix = prefix + tokens
                        self.prefixes[digest] = prefix
                    self.live[key] = prefix if prefix is not None else tokens
                    self.stored.add(key)
            else:
                for digest in event.block_hashes:
                    key = (event.medium, digest)
                    assert key in self.live, f"removed but not announced (or removed twice): {key}"
                    del self.live[key]
                    self.removed += 1

    def hashes(self, medium: str) -> set[Any]:
        return {digest for m, digest in self.live if m == medium}


class Consumer:
    """A SUB socket on a replica's publisher, and its replay socket."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: bytes = b"") -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.received: dict[int, bytes] = {}  # seq -> payload, as the SUB socket got them

    def close(self) -> None:
        self.context.destroy(linger=0)

    def poll(self, seconds: float = 0.3) -> int:
        """Take what the SUB socket has (waiting up to ``seconds`` for the first); how many batches came."""
        n = 0
        while self.sub.poll(int(seconds * 1000) if n == 0 else 50):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == self.topic
            self.received[int.from_bytes(seq, "big")] = payload
            n += 1
        return n

    def replay(self, start: int = 0, timeout: float = 10.0) -> list[tuple[int, bytes]]:
        """The batches from ``start`` on, asked of the replay socket as vLLM's subscriber asks."""
        assert self.replay_endpoint is not None
        # A DEALER: the ROUTER answers one request with many messages (a REQ socket takes one reply per request).
        request = self.context.socket(zmq.DEALER)
        request.connect(self.replay_endpoint)
        try:
            request.send_multipart((b"", start.to_bytes(8, "big")))
            batches = []
            deadline = time.monotonic() + timeout
            while True:
                assert request.poll(max(1, int((deadline - time.monotonic()) * 1000))), "the replay did not end"
                empty, topic, seq, payload = request.recv_multipart()
                assert empty == b""
                if seq == END_SEQ:
                    return batches
                assert topic == self.topic
                batches.append((int.from_bytes(seq, "big"), payload))
        finally:
            request.close(linger=0)

    def index(self, until: Any = None, timeout: float = 20.0) -> tuple[Index, list[KVEventBatch]]:
        """Every batch from sequence 0 (replayed where the SUB socket missed it), decoded and applied in order;
        waits until ``until(index)`` holds, if given."""
        deadline = time.monotonic() + timeout
        while True:
            self.poll(0.2)
            have = sorted(self.received)
            missing = 0 if not have else next((i for i in range(have[-1] + 1) if i not in self.received), None)
            if missing is not None:
                for seq, payload in self.replay(missing):
                    self.received.setdefault(seq, payload)
            batches = [DECODER.decode(self.received[seq]) for seq in sorted(self.received)]
            assert sorted(self.received) == list(range(len(batches))), "sequence numbers are not 0, 1, 2, ..."
            index = Index()
            for batch in batches:
                index.apply(batch)
            if until is None or until(index):
                return index, batches
            assert time.monotonic() < deadline, "the events never showed what was expected"
            time.sleep(0.2)
