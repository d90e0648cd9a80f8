"""ckpt-serve under real traffic, through real HTTP: dropped and interrupted streams, parallel streams, concurrent
mixed routes, generations that fail part-way and SIGTERM mid-stream. After each, the next request must answer
within a bound and with the same tokens as plain ``llama_cpp.server`` (whose answers on the plain-attention model
are those of a fresh context)."""

from __future__ import annotations

import json
import random
import signal
import socket
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from ckpt_plugin_integrations.llama_cpp_server.interrupted_streams import INTERRUPTED_STATUS
from support.servers import client, drop_stream, model_args, run_server

BOUND = 60.0  # seconds a request may take on a loaded 2-core machine; a blocked slot waits forever instead
SYSTEMS = [
    "the cat and the dog went to the house " * 10,
    "one two three four five six seven eight nine ten " * 9,
    "is it that this was the one we had in mind " * 9,
    "we had the house and the dog and it was ten " * 9,
]


def messages_of(i: int, user: str = "hello") -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEMS[i % len(SYSTEMS)]}, {"role": "user", "content": user}]


def answer(server: Any, messages: list[dict[str, str]], max_tokens: int = 8) -> str:
    started = time.monotonic()
    chat = client(server, timeout=BOUND).chat
    reply = chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0)
    assert time.monotonic() - started < BOUND
    return reply.choices[0].message.content or ""


def streamed(server: Any, messages: list[dict[str, str]], max_tokens: int = 8) -> str:
    chat = client(server, timeout=BOUND).chat
    stream = chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def drop_stream_socket(server: Any, messages: list[dict[str, str]], n_bytes: int) -> None:
    body = json.dumps({"model": "m", "messages": messages, "max_tokens": 48, "temperature": 0,
                       "stream": True}).encode()
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    with socket.create_connection(("127.0.0.1", server.port), timeout=BOUND) as sock:
        sock.sendall(request)
        received = b""
        while len(received) < n_bytes:
            data = sock.recv(4096)
            if not data:
                break
            received += data
        # an abrupt close (RST), as a killed client does
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")


@pytest.mark.parametrize("interrupt", ["true", "false"])
def test_dropped_streams_never_stop_the_server(tiny_model: Any, plain: Any, interrupt: str) -> None:
    rng = random.Random(interrupt)
    args = model_args(tiny_model("llama")) + ["--interrupt_requests", interrupt]
    with run_server(args) as ours:
        for i in range(12):
            messages = messages_of(i, f"turn {i}")
            if i % 2:
                drop_stream_socket(ours, messages, rng.randint(1, 600))
            else:
                drop_stream(ours, messages, rng.randint(1, 6), max_tokens=48, timeout=BOUND)
        for i in range(3):
            messages = messages_of(i, "and now")
            assert answer(ours, messages) == answer(plain, messages), i
            assert streamed(ours, messages) == answer(plain, messages), i
        # the conversation of a dropped stream (one that produced chunks) is still reused from the cache
        chat = client(ours, timeout=BOUND).chat
        reply = chat.completions.create(model="m", messages=messages_of(10, "turn 10"), max_tokens=4, temperature=0)
        assert reply.usage.prompt_tokens_details.cached_tokens > 50


@pytest.mark.parametrize("interrupt", ["true", "false"])
def test_parallel_streams(tiny_model: Any, plain: Any, interrupt: str) -> None:
    args = model_args(tiny_model("llama")) + ["--interrupt_requests", interrupt]
    expected = {i: answer(plain, messages_of(i), 24) for i in range(4)}
    with run_server(args) as ours:
        results: dict[int, str] = {}
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                results[i] = streamed(ours, messages_of(i), 24)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(4 * BOUND)
            assert not thread.is_alive()
        for i, text in results.items():
            assert text == expected[i], i  # a stream that ends as complete is complete, interrupted or not
        if interrupt == "true":
            # a stream cut short by a newer request ends with an error event, which the client raises
            assert all(isinstance(e, openai.APIError) and e.code == str(INTERRUPTED_STATUS) for e in errors), errors
            assert len(results) + len(errors) == 4
        else:
            assert not errors
        for i in range(4):
            assert answer(ours, messages_of(i), 24) == expected[i]


LONG = 400
"""Tokens of the first stream in the tests of one slot: it is still generating when the others arrive."""


def stream_data(server: Any, messages: list[dict[str, str]], max_tokens: int,
                on_event: Any = None, on_start: Any = None) -> list[Any]:
    """The data of every event of a streamed chat completion, read raw (an error event is data like a chunk):
    ``"[DONE]"`` as it is, the others parsed; ``on_start()`` once the response started (the host answers a stream's
    headers before it waits for the model), ``on_event(count)`` after each event."""
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    events: list[Any] = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=BOUND) as response:
        assert response.status_code == 200
        if on_start is not None:
            on_start()
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
                if on_event is not None:
                    on_event(len(events))
    return events


def ending(events: list[Any]) -> tuple[str, Any]:
    """How a stream ended: ``("complete", (text, finish_reason))`` or ``("error", error)``; anything else (no
    ``[DONE]``, no finish and no error: a silent cut) fails."""
    assert events and events[-1] == "[DONE]", events[-3:]
    chunks = [event for event in events[:-1] if "choices" in event]
    errors = [event["error"] for event in events[:-1] if "error" in event]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    if errors:
        assert not finishes and events[-2] == {"error": errors[0]}, events[-3:]
        return "error", errors[0]
    assert finishes in (["stop"], ["length"]), events[-3:]
    return "complete", (text, finishes[0])


def test_streams_on_one_slot_wait_their_turn_and_end_complete(tiny_model: Any) -> None:
    """The default --parallel 1 server: requests that arrive while a stream runs queue (ckpt-serve's default
    --interrupt_requests false), whether they stream, leave mid-stream or wait for a whole reply."""
    with run_server(model_args(tiny_model("llama"))) as ours:
        alone = {i: ending(stream_data(ours, messages_of(i), LONG if i == 0 else 48)) for i in range(3)}
        reply_alone = answer(ours, messages_of(3), 24)
        first: dict[str, Any] = {}
        started = threading.Event()
        results: dict[int, Any] = {}
        errors: list[BaseException] = []

        def run(target: Any, *args: Any, **kwargs: Any) -> Any:
            def guarded() -> None:
                try:
                    target(*args, **kwargs)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)
            return threading.Thread(target=guarded)

        accepted_at: dict[int, int] = {}  # how many events the first stream had sent when each other was accepted

        def streamed_into(i: int) -> None:
            results[i] = ending(stream_data(ours, messages_of(i), 48,
                                            on_start=lambda: accepted_at.setdefault(i, first["events"])))

        def first_stream() -> None:
            def seen(count: int) -> None:
                first["events"] = count
                started.set()
            results[0] = ending(stream_data(ours, messages_of(0), LONG, on_event=seen))

        threads = [run(first_stream)]
        threads[0].start()
        assert started.wait(BOUND)
        threads += [run(streamed_into, 1), run(streamed_into, 2),
                    run(drop_stream, ours, messages_of(4, "leaving"), 2, max_tokens=200, timeout=BOUND),
                    run(lambda: results.setdefault(3, answer(ours, messages_of(3), 24)))]
        for thread in threads[1:]:
            thread.start()
        for thread in threads:
            thread.join(8 * BOUND)
            assert not thread.is_alive()
        assert not errors, errors
        assert set(accepted_at) == {1, 2}
        assert max(accepted_at.values()) < first["events"], (accepted_at, first)  # the first was still streaming
        assert {i: results[i] for i in range(3)} == alone
        assert all(kind == "complete" for kind, _ in alone.values())
        assert results[3] == reply_alone
        # and the next requests answer as before
        assert ending(stream_data(ours, messages_of(2), 48)) == alone[2]
        assert answer(ours, messages_of(3), 24) == reply_alone


def test_a_stream_cut_by_interrupt_requests_ends_with_an_error_event(tiny_model: Any) -> None:
    """--interrupt_requests true: a newer request takes the slot, and the stream it cut says so (503), never as if
    it were complete; the newer request's stream is complete."""
    with run_server(model_args(tiny_model("llama")) + ["--interrupt_requests", "true"]) as ours:
        alone = {i: ending(stream_data(ours, messages_of(i), LONG if i == 0 else 48)) for i in range(2)}
        started = threading.Event()
        results: dict[int, tuple[str, Any]] = {}

        def first_stream() -> None:
            results[0] = ending(stream_data(ours, messages_of(0), LONG, on_event=lambda _: started.set()))

        thread = threading.Thread(target=first_stream)
        thread.start()
        assert started.wait(BOUND)
        results[1] = ending(stream_data(ours, messages_of(1), 48))
        thread.join(BOUND)
        assert not thread.is_alive()
        kind, error = results[0]
        assert kind == "error", results[0]
        assert error["code"] == INTERRUPTED_STATUS and "--interrupt_requests" in error["message"], error
        assert results[1] == alone[1]
        # The official client raises it; a request on its own still runs to its end.
        chat = client(ours, timeout=BOUND).chat
        stream = chat.completions.create(model="m", messages=messages_of(0), max_tokens=LONG, temperature=0,
                                         stream=True)
        chunks = iter(stream)
        next(chunks)
        newer = threading.Thread(target=lambda: results.__setitem__(2, ending(stream_data(ours, messages_of(1), 48))))
        newer.start()
        with pytest.raises(openai.APIError) as raised:
            for _ in chunks:
                pass
        newer.join(BOUND)
        assert raised.value.code == str(INTERRUPTED_STATUS)  # the client reads codes as text
        assert results[2] == alone[1]
        assert ending(stream_data(ours, messages_of(0), LONG)) == alone[0]


def test_concurrent_mixed_routes(tiny_model: Any, plain: Any, tmp_path: Any) -> None:
    args = model_args(tiny_model("llama")) + ["--checkpoint-admin", "true", "--slot-save-path", str(tmp_path)]
    statuses: list[tuple[str, int]] = []
    errors: list[BaseException] = []
    with run_server(args) as ours:
        http = httpx.Client(base_url=ours.url, timeout=BOUND)

        def chats(i: int) -> None:
            for turn in range(3):
                answer(ours, messages_of(i, f"mixed {turn}"))
                drop_stream(ours, messages_of(i, f"dropped {turn}"), 2, max_tokens=48, timeout=BOUND)

        def admin() -> None:
            for _ in range(10):
                for method, path, body in (
                    ("GET", "/metrics", None), ("GET", "/checkpoints", None), ("GET", "/checkpoints/stats", None),
                    ("POST", "/slots/0?action=save", {"filename": "mixed.bin"}),
                    ("POST", "/slots/0?action=restore", {"filename": "mixed.bin"}),
                    ("POST", "/slots/0?action=erase", None),
                    ("POST", "/v1/chat/completions", None),
                ):
                    if body is None and method == "POST" and path.startswith("/v1"):
                        response = http.post(path, content=b"{\"messages\": [", headers={"content-type": "application/json"})
                    else:
                        response = http.request(method, path, json=body)
                    statuses.append((path, response.status_code))

        def guarded(target: Any, *a: Any) -> None:
            try:
                target(*a)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=guarded, args=(chats, i)) for i in range(2)]
        threads += [threading.Thread(target=guarded, args=(admin,)) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(8 * BOUND)
            assert not thread.is_alive()
        assert not errors, errors
        assert all(status < 500 for _, status in statuses), [s for s in statuses if s[1] >= 500]
        for i in range(2):
            messages = messages_of(i, "after the storm")
            assert answer(ours, messages) == answer(plain, messages)


def test_failing_requests_leave_the_server_answering(tiny_model: Any, plain: Any) -> None:
    with run_server(model_args(tiny_model("llama"))) as ours:
        http = httpx.Client(base_url=ours.url, timeout=BOUND)
        bad_grammar = http.post("/v1/chat/completions", json={"messages": messages_of(0), "grammar": "root ::= ("})
        assert bad_grammar.status_code == 422 and bad_grammar.json()["error"]["code"] == "invalid_grammar"
        # a context overflow fails inside the host's generation
        long = http.post("/v1/completions", json={"prompt": "the cat " * 3000, "max_tokens": 4})
        assert 400 <= long.status_code < 500
        messages = messages_of(1, "still there")
        assert answer(ours, messages) == answer(plain, messages)


def test_sigterm_during_a_stream_parks_the_slot_and_loses_nothing(tiny_model: Any, tmp_path: Any) -> None:
    args = model_args(tiny_model("llama")) + ["--checkpoint-disk-dir", str(tmp_path / "disk")]
    messages = messages_of(2, "remember me")
    with run_server(args) as ours:
        answer(ours, messages)
        files_before = set((tmp_path / "disk").glob("*.ckpt"))
        body = {"model": "m", "messages": messages_of(3, "streaming"), "max_tokens": 400, "temperature": 0,
                "stream": True}
        with httpx.stream("POST", f"{ours.url}/v1/chat/completions", json=body, timeout=BOUND) as response:
            lines = response.iter_lines()
            next(lines)
            started = time.monotonic()
            ours.process.send_signal(signal.SIGTERM)
            for _ in lines:  # the server ends the stream
                pass
        ours.process.wait(timeout=30)
        assert time.monotonic() - started < 30
        # uvicorn re-raises the signal once shut down, so the exit status says "terminated by SIGTERM"
        assert ours.process.returncode in (0, -signal.SIGTERM), "".join(ours.log)[-3000:]
        time.sleep(0.5)  # the log reader thread drains the pipe
        assert "Application shutdown complete" in "".join(ours.log)
        files_after = set((tmp_path / "disk").glob("*.ckpt"))
        assert files_before <= files_after and len(files_after) > len(files_before)  # the slot was parked
        assert not list((tmp_path / "disk").glob(".*.tmp"))
    with run_server(args) as again:
        chat = client(again, timeout=BOUND).chat
        reply = chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0)
        assert reply.usage.prompt_tokens_details.cached_tokens > 50
