"""A stream cut short by ``--interrupt_requests true`` ends with an error event, never as if it were complete.

With ``interrupt_requests`` (llama_cpp.server's default; ckpt-serve's is false, docs/server.md), the host's stream
publisher checks after each chunk whether another request waits for the model and, if one does, sends
``data: [DONE]`` and stops: the client saw a 200, a last chunk with ``finish_reason: null`` and a normal end, with
no sign that its reply was cut. :func:`report_interruptions` wraps the publisher so that such a stream ends with an
error event in OpenAI's shape before ``[DONE]`` (:func:`interrupted_event`), which OpenAI's clients raise as an
``APIError``.

A cut is told from a normal end by the host's own iterator: the publisher sends ``[DONE]`` either after the
iterator is exhausted (a normal end) or while it still had chunks to give (a cut). A stream whose chunks already
carried a ``finish_reason`` is complete, whatever is left of the iterator.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterator

import llama_cpp.server.app as host

INTERRUPTED_STATUS = 503
"""The error event's ``code``: as for a full pool of cells, the server gave the model to another request, and the
same request sent again is served."""

INTERRUPTED_MESSAGE = (
    "the reply was cut short: another request arrived and --interrupt_requests true gives it the model; send the "
    "request again, or start ckpt-serve with --interrupt_requests false (its default) to queue requests instead"
)


def interrupted_event() -> dict[str, Any]:
    """The error event that ends an interrupted stream (before ``[DONE]``)."""
    return {"error": {"message": INTERRUPTED_MESSAGE, "type": "server_busy", "code": INTERRUPTED_STATUS}}


class WatchedChunks:
    """An iterator over the host's chunks that knows whether it ran to its end and whether a chunk finished a
    choice.

    :param chunks: What the host's ``llama_call`` returned for a streamed request.
    """

    def __init__(self, chunks: Iterator[Any]) -> None:
        self.chunks = iter(chunks)
        self.exhausted = False
        self.finished = False

    def __iter__(self) -> WatchedChunks:
        return self

    def __next__(self) -> Any:
        try:
            chunk = next(self.chunks)
        except StopIteration:
            self.exhausted = True
            raise
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        if any(isinstance(c, dict) and c.get("finish_reason") is not None for c in choices or ()):
            self.finished = True
        return chunk

    def close(self) -> None:
        """Close the host's iterator (a generator: its ``finally`` frees what the request held)."""
        close = getattr(self.chunks, "close", None)
        if close is not None:
            close()

    @property
    def cut(self) -> bool:
        """The stream ends with chunks left and no choice finished."""
        return not self.exhausted and not self.finished


class _ReportingChannel:
    """The publisher's send channel, with the error event put before a ``[DONE]`` that ends a cut stream."""

    def __init__(self, channel: Any, watched: list[WatchedChunks]) -> None:
        self.channel = channel
        self.watched = watched

    async def send(self, item: Any) -> None:
        if isinstance(item, dict) and item.get("data") == "[DONE]" and any(w.cut for w in self.watched):
            await self.channel.send(dict(data=json.dumps(interrupted_event())))
        await self.channel.send(item)

    async def __aenter__(self) -> _ReportingChannel:
        await self.channel.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> Any:
        return await self.channel.__aexit__(*exc_info)


def report_interruptions() -> None:
    """Replace the host's stream publisher (``llama_cpp.server.app.get_event_publisher``, which its routes look up
    by name for every streamed request) with one that reports a cut stream (see the module docstring). Idempotent."""
    original = host.get_event_publisher
    if getattr(original, "reports_interruptions", False):
        return

    async def get_event_publisher(request: Any, inner_send_chan: Any, body: Any, body_model: Any,
                                  llama_call: Callable[..., Any], kwargs: Any) -> None:
        watched: list[WatchedChunks] = []

        def watched_call(llama: Any, **call_kwargs: Any) -> Any:
            chunks = WatchedChunks(llama_call(llama, **call_kwargs))
            watched.append(chunks)
            return chunks

        await original(request=request, inner_send_chan=_ReportingChannel(inner_send_chan, watched), body=body,
                       body_model=body_model, llama_call=watched_call, kwargs=kwargs)

    get_event_publisher.reports_interruptions = True  # type: ignore[attr-defined]
    host.get_event_publisher = get_event_publisher
