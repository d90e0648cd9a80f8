"""``usage.prompt_tokens_details.cached_tokens`` on completion responses, as OpenAI and vLLM report it.

For streamed responses requested with ``stream_options.include_usage`` the final usage chunk gets the field too
(and is added before ``data: [DONE]`` when the host sends none).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ckpt_plugin.core.request import RequestScope

__all__ = ["UsageRewriter"]


class UsageRewriter:
    """Adds ``prompt_tokens_details.cached_tokens`` to one completion response."""

    def __init__(self, app: ASGIApp, request_scope: RequestScope, request_body: bytes) -> None:
        self.app = app
        self.request_scope = request_scope
        self.request_body = request_body
        self.start: Message | None = None
        self.body = bytearray()
        self.streaming = False
        self.pending = b""
        self.completion_chunks = 0
        self.last_chunk: dict[str, Any] = {}
        self.usage_sent = False
        self.passthrough = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def rewrite(message: Message) -> None:
            if message["type"] == "http.response.start":
                content_type = Headers(raw=message["headers"]).get("content-type", "")
                self.streaming = content_type.startswith("text/event-stream")
                if self.streaming or message["status"] != 200 or not content_type.startswith("application/json"):
                    self.streaming = self.streaming and message["status"] == 200
                    self.passthrough = not self.streaming
                    await send(message)
                    return
                self.start = message
                return
            if message["type"] != "http.response.body" or self.passthrough:
                await send(message)
                return
            if self.streaming:
                await send({**message, "body": self._rewrite_events(message.get("body", b""),
                                                                    more=message.get("more_body", False))})
                return
            self.body.extend(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = self._rewrite_json(bytes(self.body))
            assert self.start is not None
            headers = MutableHeaders(raw=list(self.start["headers"]))
            headers["content-length"] = str(len(body))
            await send({**self.start, "headers": headers.raw})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        await self.app(scope, receive, rewrite)

    def _details(self) -> dict[str, int]:
        return {"cached_tokens": self.request_scope.cached_tokens}

    def _rewrite_json(self, body: bytes) -> bytes:
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):
            return body
        usage = payload.get("usage") if isinstance(payload, dict) else None
        if isinstance(usage, dict):
            usage["prompt_tokens_details"] = self._details()
            return json.dumps(payload).encode()
        return body

    def _wants_usage(self) -> bool:
        try:
            request = json.loads(self.request_body or b"{}")
        except (ValueError, RecursionError):
            return False
        options = request.get("stream_options") if isinstance(request, dict) else None
        return isinstance(options, dict) and bool(options.get("include_usage"))

    def _rewrite_events(self, body: bytes, more: bool) -> bytes:
        data = self.pending + body
        separator = b"\r\n\r\n" if b"\r\n\r\n" in data else b"\n\n"
        *events, self.pending = data.split(separator)
        if not more and self.pending:
            events.append(self.pending)
            self.pending = b""
        out = []
        for event in events:
            out.append(self._rewrite_event(event))
        return b"".join(e + separator for e in out)

    def _rewrite_event(self, event: bytes) -> bytes:
        lines = event.split(b"\n")
        data_lines = [line for line in lines if line.strip().startswith(b"data:")]
        if not data_lines:
            return event
        data = b"".join(line.strip()[5:].strip() for line in data_lines)
        if data == b"[DONE]":
            if self._wants_usage() and not self.usage_sent:
                chunk = {k: self.last_chunk.get(k) for k in ("id", "object", "created", "model")}
                prompt = self.request_scope.prompt_tokens
                # The tokens generated, as the host counts them in a response that is not streamed (a stop string's
                # tokens are generated although their text is not sent); chunks of text for a model not attached.
                completion = self.request_scope.completion_tokens
                if completion is None:
                    completion = self.completion_chunks
                chunk.update(choices=[], usage={
                    "prompt_tokens": prompt, "completion_tokens": completion,
                    "total_tokens": prompt + completion, "prompt_tokens_details": self._details(),
                })
                self.usage_sent = True
                return b"data: " + json.dumps(chunk).encode() + b"\r\n\r\n" + event
            return event
        try:
            chunk = json.loads(data)
        except (ValueError, RecursionError):
            return event
        if not isinstance(chunk, dict):
            return event
        self.last_chunk = chunk
        if any(_has_text(choice) for choice in chunk.get("choices") or []):
            self.completion_chunks += 1
        if isinstance(chunk.get("usage"), dict):
            chunk["usage"]["prompt_tokens_details"] = self._details()
            self.usage_sent = True
            return b"data: " + json.dumps(chunk).encode()
        return event


def _has_text(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    return bool(choice.get("text") or (isinstance(delta, dict) and delta.get("content")))
