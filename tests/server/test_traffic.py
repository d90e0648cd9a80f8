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
import pytest

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
        assert not errors
        for i, text in results.items():
            if interrupt == "true":
                # a stream interrupted by a newer request ends early, with what it had produced
                assert expected[i].startswith(text), i
            else:
                assert text == expected[i], i
        for i in range(4):
            assert answer(ours, messages_of(i), 24) == expected[i]


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
