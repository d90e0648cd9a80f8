"""Holding a server's slots with long streamed replies, to see what it answers while no slot is free."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

import httpx

from ckpt_plugin.testing.waiting import wait_until

BOUND = 120.0
"""Seconds a wait may take: a bound against a hang, never a measure."""

HEALTH_NO_SLOT = {"error": {"code": 503, "message": "no slot available", "type": "unavailable_error"}}
"""llama-server's answer to ``/health?fail_on_no_slot=1`` while every slot is busy."""


@dataclass
class HeldStream:
    """One stream holding a slot: whether it got its first token, whether its reply ended (it must not, while held),
    and any failure of its thread."""

    started: threading.Event = field(default_factory=threading.Event)
    ended: bool = False
    error: BaseException | None = None


def no_slot_free(server: Any) -> bool:
    """Whether ``/health?fail_on_no_slot=1`` says every slot is busy (checking its body is llama-server's)."""
    response = httpx.get(f"{server.url}/health?fail_on_no_slot=1", timeout=BOUND)
    if response.status_code == 503:
        assert response.json() == HEALTH_NO_SLOT, response.text
        return True
    assert response.status_code == 200 and response.json() == {"status": "ok"}, response.text
    return False


@contextlib.contextmanager
def slots_held(server: Any, n: int, *, max_tokens: int = 1500) -> Iterator[list[HeldStream]]:
    """``n`` streamed chat completions of ``max_tokens`` tokens (``ignore_eos``), each read to its first token and
    then left unread until the block ends, when each client disconnects (its slot is freed at the next token). The
    block starts once every slot the streams can hold is busy (``fail_on_no_slot``); the slots then stay busy, as a
    reply of ``max_tokens`` takes far longer than any check the block makes."""
    release = threading.Event()
    held = [HeldStream() for _ in range(n)]

    def hold(i: int, stream: HeldStream) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": f"tell me a long story {i}"}],
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=BOUND) as response:
                for line in response.iter_lines():
                    if line.startswith("data:") and not stream.started.is_set():
                        stream.started.set()
                        release.wait(BOUND)
                        return  # leaving the block closes the connection mid-stream
                    if line == "data: [DONE]":
                        stream.ended = True
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            stream.error = exc
        finally:
            stream.started.set()

    threads = [threading.Thread(target=hold, args=(i, stream), daemon=True) for i, stream in enumerate(held)]
    for thread in threads:
        thread.start()
    try:
        for stream in held:
            assert stream.started.wait(BOUND), "a stream got no token"
            assert stream.error is None, stream.error
        wait_until(lambda: no_slot_free(server), BOUND, message="the streams never held every slot")
        yield held
    finally:
        release.set()
        for thread in threads:
            thread.join(BOUND)
    assert all(stream.error is None and not stream.ended for stream in held), held
