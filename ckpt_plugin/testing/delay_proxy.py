"""A TCP proxy that makes a local server look far away: in each direction, a one-way delay and a bandwidth limit,
like a link (an asyncio event loop on a thread of its own): a far shared tier for tests and benchmarks.

Each chunk read from one side leaves the proxy once the link has carried it (``bandwidth`` bytes a second, one chunk
after the other) plus ``one_way_delay``; a request and its answer therefore take at least ``2 * one_way_delay``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Iterator

__all__ = ["DelayProxy", "delay_proxy"]


class DelayProxy:
    """Listens on 127.0.0.1 (:attr:`port`) and forwards every connection to ``host:port`` through a slow link.

    :param one_way_delay: Seconds each chunk takes to cross, each way.
    :param bandwidth: Bytes per second each way.
    :ivar bytes_forwarded: Bytes carried so far, both ways.
    """

    def __init__(self, host: str, port: int, *, one_way_delay: float = 0.010, bandwidth: float = 50e6) -> None:
        self.target = (host, port)
        self.one_way_delay = one_way_delay
        self.bandwidth = bandwidth
        self.bytes_forwarded = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="delay-proxy", daemon=True)

    @property
    def url(self) -> str:
        """A ``redis://`` URL through the proxy."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> DelayProxy:
        """Start listening (on a free port, :attr:`port`); ``self``.

        :raises RuntimeError: The proxy's loop did not start within 10 s.
        """
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the delay proxy did not start")
        return self

    def stop(self) -> None:
        """Stop the loop: every connection through the proxy ends."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._server.close()
            for task in asyncio.all_tasks(self._loop):
                task.cancel()
            self._loop.run_until_complete(asyncio.sleep(0))
            self._loop.close()

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(self._link(client_reader, server_writer), self._link(server_reader, client_writer),
                             return_exceptions=True)

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Carry ``reader``'s bytes to ``writer`` through the delay and the bandwidth limit, in order."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                at, data = await queue.get()
                wait = at - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    break
                writer.write(data)
                await writer.drain()
            with contextlib.suppress(OSError):
                writer.close()

        delivering = loop.create_task(deliver())
        link_free = 0.0
        try:
            while True:
                data = await reader.read(1 << 16)
                now = loop.time()
                if data:
                    self.bytes_forwarded += len(data)
                    link_free = max(now, link_free) + len(data) / self.bandwidth
                    queue.put_nowait((link_free + self.one_way_delay, data))
                else:
                    queue.put_nowait((max(now, link_free) + self.one_way_delay, b""))
                    break
        except OSError:
            queue.put_nowait((0.0, b""))
        await delivering


@contextlib.contextmanager
def delay_proxy(host: str, port: int, **options: float) -> Iterator[DelayProxy]:
    """A running :class:`DelayProxy` to ``host:port``, stopped after."""
    proxy = DelayProxy(host, port, **options).start()
    try:
        yield proxy
    finally:
        proxy.stop()
