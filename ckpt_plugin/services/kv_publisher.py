"""The KV events' ZeroMQ publisher: vLLM's ``ZmqEventPublisher`` on a thread of its own, fed by the page store.

:class:`KvEventPublisher` is a :class:`~ckpt_plugin.core.pages.PageListener`: the threads that capture and drop
states only append a notification to a bounded queue (past ``max_queue_size`` it is dropped and counted) and, the
first time since the thread last looked, write one byte to a pipe that wakes it. The thread turns the notifications
into events (:class:`~ckpt_plugin.services.kv_events.KvEventTracker`) and sends them as vLLM does:

- the PUB socket sends each batch as three frames: ``topic``, the batch's sequence number (8 bytes, big-endian,
  from 0 at start), the msgpack payload;
- the last ``buffer_steps`` batches are kept for the ROUTER socket at ``replay_endpoint``: a request
  ``[identity, "", start_seq (8 bytes)]`` is answered with ``[identity, "", topic, seq, payload]`` for every kept
  batch from ``start_seq`` on, then ``[identity, "", "", -1 (8 bytes), ""]``;
- the first batch is ``AllBlocksCleared``: whatever a consumer knew of this replica before it started is gone.

Nothing here blocks a request: the queue is a deque, the wake-up a non-blocking write, and a consumer too slow for
the PUB socket's high-water mark loses messages there (it can ask the replay socket for them).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any, Sequence

import zmq

from ckpt_plugin.core.kv_events_config import KvEventsConfig
from ckpt_plugin.core.pages import PageInfo
from ckpt_plugin.services.kv_events import KvEventTracker, encode_batch, int_block_hashes

__all__ = ["END_SEQ", "KvEventPublisher"]

log = logging.getLogger("ckpt_plugin")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence number that ends a replay."""
BATCH_WINDOW = 0.002
"""Seconds the thread waits, once woken, for the rest of a burst (a capture's pages) to make one batch."""


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, IPv6-any, ipc:// or inproc:// address; connect to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher:
    """Publishes the page store's notifications as vLLM's KV event batches (see the module's docstring).

    :param config: vLLM's ``KVEventsConfig`` (endpoints, topic, buffer_steps, hwm, max_queue_size).
    :param data_parallel_rank: The batches' ``data_parallel_rank`` (vLLM's rank of the engine: 0 here).
    :raises zmq.ZMQError: An endpoint cannot be bound or connected.
    """

    def __init__(self, config: KvEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.rank = data_parallel_rank
        self._topic = config.topic.encode()
        self._queue: collections.deque[tuple[Any, ...]] = collections.deque()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self._tracker = KvEventTracker(as_int=int_block_hashes())
        self._context = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket[Any] | None = None
        try:
            self.endpoint = self._open(self._pub, config.endpoint)
            self.replay_endpoint = None
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                # A whole replay and its end marker fit in the queue of a slow requester (as vLLM sizes it).
                self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
                self.replay_endpoint = self._open(self._replay, config.replay_endpoint, bind=True)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)
        self._signalled = False
        self._running = True
        self._seq = 0
        self.drops = 0
        self.notifications = 0
        self.events = 0
        self.batches = 0
        self.bytes = 0
        self.thread_seconds = 0.0
        self._put(("cleared", None))  # the first batch, sent at once: AllBlocksCleared
        self._thread = threading.Thread(target=self._run, name="ckpt-kv-events", daemon=True)
        self._thread.start()

    @staticmethod
    def _open(socket: zmq.Socket[Any], endpoint: str, bind: bool = False) -> str:
        """Bind or connect ``socket``; the address a subscriber reaches (a port 0 resolved)."""
        if bind or _binds(endpoint):
            socket.bind(endpoint)
            return socket.getsockopt_string(zmq.LAST_ENDPOINT) if endpoint.endswith(":0") else endpoint
        socket.connect(endpoint)
        return endpoint

    # ------------------------------------------------------------------------------------------------------------
    # PageListener: called on the threads that store and drop pages

    def page_stored(self, info: PageInfo, token: int) -> None:
        self._put(("stored", info, token))

    def page_gone(self, page_id: bytes, token: int) -> None:
        self._put(("gone", page_id, token))

    def tier_stored(self, tier: str, page_ids: Sequence[bytes]) -> None:
        self._put(("tier_stored", tier, tuple(page_ids)))

    def cleared(self, namespace: str | None) -> None:
        self._put(("cleared", namespace))

    def _put(self, notification: tuple[Any, ...]) -> None:
        # No lock: a page's finalizer calls this from inside the garbage collector, wherever it runs.
        if not self._running:
            return
        if len(self._queue) >= self.config.max_queue_size:
            self.drops += 1
            return
        self._queue.append(notification)
        if not self._signalled:
            self._signalled = True
            try:
                os.write(self._wake_write, b"x")
            except (BlockingIOError, OSError):
                pass  # the pipe is full (the thread will read it) or closed (shut down)

    # ------------------------------------------------------------------------------------------------------------
    # the thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_read, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(1000))
            started = time.thread_time()
            if self._replay is not None and ready.get(self._replay):
                self._serve_replays()
            if ready.get(self._wake_read):
                time.sleep(BATCH_WINDOW)
                os.read(self._wake_read, 4096)
            # Reset before draining: a notification queued after the drain starts wakes the thread again.
            self._signalled = False
            self._publish_queued()
            self.thread_seconds += time.thread_time() - started
            if not self._running:
                self._publish_queued()
                return

    def _publish_queued(self) -> None:
        n = 0
        while self._queue:
            self._tracker.apply(self._queue.popleft())
            n += 1
        self.notifications += n
        events = self._tracker.take()
        if not events:
            return
        payload = encode_batch(time.time(), events, self.rank)
        seq = self._seq.to_bytes(8, "big")
        try:
            self._pub.send_multipart((self._topic, seq, payload), copy=False)
        except zmq.ZMQError as exc:  # never fatal: the batch stays in the replay buffer
            log.warning("KV events: a batch was not sent: %s", exc)
        self._buffer.append((self._seq, payload))
        self._seq += 1
        self.events += len(events)
        self.batches += 1
        self.bytes += len(payload)

    def _serve_replays(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                log.warning("KV events: a replay request of %d frames, not 3, was ignored", len(frames))
                continue
            identity, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart((identity, b"", self._topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((identity, b"", b"", END_SEQ, b""))

    # ------------------------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters: notifications taken, events, batches and payload bytes sent, notifications dropped (a full
        queue), pages not announced (not whole), the next sequence number, the thread's CPU seconds, the queue's
        depth and the pages announced and not gone."""
        return {"notifications": self.notifications, "events": self.events, "batches": self.batches,
                "bytes": self.bytes,
                "drops": self.drops, "not_whole": self._tracker.not_whole, "next_seq": self._seq,
                "thread_seconds": self.thread_seconds, "queue_depth": len(self._queue),
                "announced": len(self._tracker)}

    def sources(self) -> dict[str, dict[str, Any]]:
        """vLLM's ``GET /kv_event_sources``: this publisher's configuration by data-parallel rank, its endpoints as
        bound (a port 0 resolved)."""
        resolved = self.config.model_copy(update={"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint})
        return {str(self.rank): resolved.model_dump()}

    def close(self, timeout: float = 2.0) -> None:
        """Publish what is queued, stop the thread and close the sockets."""
        if not self._running:
            return
        self._running = False
        self._signalled = True  # no notification writes to the pipe from now on: its descriptors are closed below
        try:
            os.write(self._wake_write, b"x")
        except OSError:
            pass
        self._thread.join(timeout)
        self._close_sockets()
        for fd in (self._wake_read, self._wake_write):
            os.close(fd)

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
