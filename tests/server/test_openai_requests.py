"""What OpenAI clients and the routers in front of them send, through real HTTP to real ckpt-serve processes: chats
without messages, images, audio and files where no projector reads them (and images where one does),
``max_completion_tokens`` (the API's current name of ``max_tokens``) and ``X-Request-Id`` as a router forwards it.

Each refusal is a 4xx JSON error in OpenAI's shape, each limit is honoured streamed or not, and after each (and after
clients that leave mid-stream) the server answers the next request as before.
"""

from __future__ import annotations

import json
import pathlib
import re
import threading
import uuid
from typing import Any, Iterator

import httpx
import openai
import pytest

from ckpt_plugin.testing.tiny_models import image_data_uri, mmproj_positions_per_image, tiny_png, write_tiny_mmproj
from support.servers import client, drop_stream, model_args, run_server

BOUND = 120
HELLO = [{"role": "user", "content": "hello there"}]


def refused(response: httpx.Response, status: int, code: str) -> str:
    """The message of a JSON error ``{"error": {"code", "message"}}`` of ``status`` and ``code``."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == code, error
    assert isinstance(error["message"], str) and error["message"]
    return error["message"]


def answers(server: Any) -> str:
    """A plain chat answers (the server is alive and serving); its reply."""
    assert server.process.poll() is None, "".join(server.log)[-3000:]
    reply = server.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] >= 1
    return str(reply.json()["choices"][0]["message"]["content"])


def stream_events(server: Any, route: str, body: dict[str, Any], headers: dict[str, str] | None = None
                  ) -> tuple[httpx.Headers, list[Any]]:
    """A streamed request's response headers and the data of its events (``"[DONE]"`` as it is, the rest parsed)."""
    with httpx.stream("POST", f"{server.url}{route}", json={**body, "stream": True}, headers=headers,
                      timeout=BOUND) as response:
        assert response.status_code == 200
        data = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    return response.headers, [item if item == "[DONE]" else json.loads(item) for item in data]


@pytest.fixture(scope="module")
def server(tiny_model: Any) -> Iterator[Any]:
    with run_server(model_args(tiny_model("llama"), n_ctx=512) + ["--admin", "true"]) as running:
        yield running


# -------------------------------------------------------------------------------------------------------------------
# A chat without messages


@pytest.mark.parametrize("body", [{"messages": []}, {}], ids=["empty", "missing"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_without_messages_is_a_400(server: Any, body: dict[str, Any], stream: bool) -> None:
    message = refused(server.post("/v1/chat/completions", json={**body, "max_tokens": 4, "stream": stream}), 400,
                      "invalid_request")
    assert "at least one message" in message
    answers(server)


def test_the_openai_client_gets_a_bad_request_error_for_no_messages(server: Any) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client(server).chat.completions.create(model="m", messages=[], max_tokens=4)
    assert raised.value.status_code == 400 and "at least one message" in str(raised.value)
    answers(server)


# -------------------------------------------------------------------------------------------------------------------
# Images, audio and files


IMAGE = {"type": "image_url", "image_url": {"url": image_data_uri(tiny_png(1))}}
MEDIA = {
    "image_url": IMAGE,
    "input_audio": {"type": "input_audio", "input_audio": {"data": "UklGRiQAAABXQVZF", "format": "wav"}},
    "file": {"type": "file", "file": {"filename": "a.pdf", "file_data": "data:application/pdf;base64,JVBERi0="}},
}


def with_part(part: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]


@pytest.mark.parametrize("kind", list(MEDIA))
def test_media_parts_without_a_projector_are_refused_naming_the_flags(server: Any, kind: str) -> None:
    for stream in (False, True):
        message = refused(server.post("/v1/chat/completions", json={
            "messages": with_part(MEDIA[kind]), "max_tokens": 4, "stream": stream}), 400, "multimodal_disabled")
        assert message.startswith("messages[1].content[1] is "), message
        assert f"(type {kind})" in message and "dropped" in message
        assert "--clip_model_path" in message and "--chat_format" in message, message
    with pytest.raises(openai.BadRequestError) as raised:
        client(server).chat.completions.create(
            model="m", messages=with_part(MEDIA[kind]), max_tokens=4)  # type: ignore[arg-type]
    assert raised.value.status_code == 400 and "--clip_model_path" in str(raised.value)
    answers(server)


@pytest.fixture(scope="module")
def vision(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """ckpt-serve with a multimodal chat format and its projector (the tiny one, for the tiny llama)."""
    mmproj = write_tiny_mmproj(pathlib.Path(tmp_path_factory.mktemp("mmproj")) / "mmproj.gguf")
    args = model_args(tiny_model("llama")) + ["--chat_format", "llava-1-5", "--clip_model_path", str(mmproj)]
    with run_server(args) as running:
        yield running


def test_a_server_with_a_projector_reads_images_and_refuses_what_it_cannot_read(vision: Any) -> None:
    body = {"messages": with_part(IMAGE), "max_tokens": 6, "temperature": 0}
    first = vision.post("/v1/chat/completions", json=body)
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["prompt_tokens"] > mmproj_positions_per_image()  # the image is in the prompt
    # A client that leaves mid-stream, and one that streams alongside it, change nothing for the next request.
    threads = [threading.Thread(target=drop_stream, args=(vision, with_part(IMAGE), 2),
                                kwargs={"max_tokens": 40, "timeout": BOUND}),
               threading.Thread(target=stream_events, args=(vision, "/v1/chat/completions", body))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(BOUND)
        assert not thread.is_alive()
    again = vision.post("/v1/chat/completions", json=body).json()
    assert again["choices"][0]["message"] == first.json()["choices"][0]["message"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the image was reused, not encoded again
    for kind in ("input_audio", "file"):
        message = refused(vision.post("/v1/chat/completions", json={"messages": with_part(MEDIA[kind])}), 400,
                          "multimodal_disabled")
        assert "reads text and image_url parts only" in message, message


# -------------------------------------------------------------------------------------------------------------------
# max_completion_tokens


ROUTES = {"/v1/chat/completions": {"messages": HELLO}, "/v1/completions": {"prompt": "the cat sat on the"}}


def text_of(route: str, reply: dict[str, Any]) -> str:
    choice = reply["choices"][0]
    return str(choice["message"]["content"] if route.endswith("chat/completions") else choice["text"])


@pytest.mark.parametrize("route", list(ROUTES))
def test_max_completion_tokens_is_the_limit_of_the_reply(server: Any, route: str) -> None:
    body = {**ROUTES[route], "temperature": 0}
    limited = server.post(route, json={**body, "max_completion_tokens": 5}).json()
    assert limited["usage"]["completion_tokens"] == 5, limited
    assert limited["choices"][0]["finish_reason"] == "length"
    older = server.post(route, json={**body, "max_tokens": 5}).json()
    assert text_of(route, limited) == text_of(route, older)
    # Both names with the same value; null as if it were not given.
    both = server.post(route, json={**body, "max_tokens": 5, "max_completion_tokens": 5}).json()
    assert both["usage"]["completion_tokens"] == 5
    nulled = server.post(route, json={**body, "max_tokens": 3, "max_completion_tokens": None}).json()
    assert nulled["usage"]["completion_tokens"] == 3
    # Streamed: the same tokens, the same finish, the same count in the usage chunk.
    _, events = stream_events(server, route, {**body, "max_completion_tokens": 5,
                                              "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [event for event in events[:-1] if event["choices"]]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert finishes == ["length"]
    usage = [event["usage"] for event in events[:-1] if event.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 5
    pieces = [c["choices"][0]["delta"].get("content") or "" if "delta" in c["choices"][0] else c["choices"][0]["text"]
              for c in chunks]
    assert "".join(pieces) == text_of(route, limited)


def test_the_openai_client_s_max_completion_tokens_is_honoured(server: Any) -> None:
    chat = client(server).chat.completions.create(
        model="m", messages=HELLO, max_completion_tokens=5, temperature=0)  # type: ignore[arg-type]
    assert chat.usage is not None and chat.usage.completion_tokens == 5
    assert chat.choices[0].finish_reason == "length"
    completion = client(server).completions.create(model="m", prompt="the cat sat on the", temperature=0,
                                                   extra_body={"max_completion_tokens": 5})
    assert completion.usage is not None and completion.usage.completion_tokens == 5
    assert completion.choices[0].finish_reason == "length"


@pytest.mark.parametrize("route", list(ROUTES))
def test_max_completion_tokens_that_cannot_be_a_limit_are_refused(server: Any, route: str) -> None:
    conflict = refused(server.post(route, json={**ROUTES[route], "max_tokens": 8, "max_completion_tokens": 5}),
                       400, "invalid_request")
    assert "max_tokens (8) and max_completion_tokens (5) differ" in conflict
    for value in (0, -1, "5", True, 2.5):
        message = refused(server.post(route, json={**ROUTES[route], "max_completion_tokens": value}), 422,
                          "invalid_request")
        assert "max_completion_tokens must be a whole number of at least 1" in message
    answers(server)


def test_clients_that_leave_mid_stream_leave_the_limit_honoured(server: Any) -> None:
    for lines in (1, 3):
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=BOUND, json={
                "messages": HELLO, "max_completion_tokens": 300, "stream": True}) as response:
            for i, _ in enumerate(response.iter_lines()):
                if i >= lines:
                    break
    reply = server.post("/v1/chat/completions", json={"messages": HELLO, "max_completion_tokens": 5}).json()
    assert reply["usage"]["completion_tokens"] == 5 and reply["choices"][0]["finish_reason"] == "length"


# -------------------------------------------------------------------------------------------------------------------
# X-Request-Id


FORWARDED_IDS = [
    "req-123",
    str(uuid.uuid4()),
    "Root=1-5759e988-bd862e3fe1be46a994272793;Parent=53995c3f42cd8ad8;Sampled=1",  # an AWS trace id
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # a W3C traceparent
    "x" * 200,
]


def requests_of_every_kind() -> list[tuple[str, str, Any]]:
    """``(method, path, json body)``: host routes, the plugin's routes and a refusal of the middleware's."""
    return [
        ("POST", "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2}),
        ("POST", "/v1/completions", {"prompt": "the cat", "max_tokens": 2}),
        ("GET", "/v1/models", None),
        ("GET", "/metrics", None),
        ("GET", "/checkpoints/stats", None),
        ("POST", "/v1/chat/completions", {"messages": []}),  # 400 from the middleware
        ("POST", "/v1/completions", {"prompt": 5}),  # 422 from the schema check
    ]


@pytest.mark.parametrize("request_id", FORWARDED_IDS, ids=["short", "uuid", "aws", "traceparent", "longest"])
def test_a_forwarded_request_id_is_kept_and_echoed_on_every_route(server: Any, request_id: str) -> None:
    for method, path, body in requests_of_every_kind():
        response = httpx.request(method, f"{server.url}{path}", json=body, headers={"X-Request-Id": request_id},
                                 timeout=BOUND)
        assert response.status_code < 500, (path, response.text)
        assert response.headers.get_list("x-request-id") == [request_id], (path, response.headers)
    headers, events = stream_events(server, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 3},
                                    headers={"X-Request-Id": request_id})
    assert headers.get_list("x-request-id") == [request_id] and events[-1] == "[DONE]"


def test_the_openai_client_s_request_id_comes_back(server: Any) -> None:
    raw = client(server).chat.completions.with_raw_response.create(
        model="m", messages=HELLO, max_tokens=2, extra_headers={"X-Request-Id": "req-123"})  # type: ignore[arg-type]
    assert raw.status_code == 200 and raw.headers["x-request-id"] == "req-123"
    assert raw.parse().choices[0].finish_reason in ("stop", "length")


def test_a_request_without_an_id_gets_a_new_one(server: Any) -> None:
    seen = set()
    for headers in ({}, {"X-Request-Id": ""}):
        for method, path, body in requests_of_every_kind():
            response = httpx.request(method, f"{server.url}{path}", json=body, headers=headers, timeout=BOUND)
            (request_id,) = response.headers.get_list("x-request-id")
            assert re.fullmatch(r"[0-9a-f]{32}", request_id), request_id
            seen.add(request_id)
    assert len(seen) == 2 * len(requests_of_every_kind())


@pytest.mark.parametrize("request_id", ["x" * 201, "a b", "tab\there", "caf\u00e9".encode("utf-8")],
                         ids=["too-long", "space", "tab", "non-ascii"])
def test_an_unreasonable_request_id_is_a_400_that_says_why(server: Any, request_id: Any) -> None:
    for method, path, body in requests_of_every_kind():
        response = httpx.request(method, f"{server.url}{path}", json=body, headers={"X-Request-Id": request_id},
                                 timeout=BOUND)
        message = refused(response, 400, "invalid_request_id")
        assert "1 to 200 visible ASCII characters" in message
        assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"])
    answers(server)


def test_concurrent_streams_each_get_their_own_id_and_a_dropped_one_changes_nothing(server: Any) -> None:
    results: dict[str, httpx.Headers] = {}
    errors: list[BaseException] = []

    def run(request_id: str) -> None:
        try:
            headers, events = stream_events(server, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 24},
                                            headers={"X-Request-Id": request_id})
            assert events[-1] == "[DONE]"
            results[request_id] = headers
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    ids = [f"client-{i}" for i in range(3)]
    threads = [threading.Thread(target=run, args=(request_id,)) for request_id in ids]
    threads.append(threading.Thread(target=drop_stream, args=(server, HELLO, 2),
                                    kwargs={"max_tokens": 200, "timeout": BOUND}))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(BOUND)
        assert not thread.is_alive()
    assert not errors, errors
    assert {request_id: headers.get_list("x-request-id") for request_id, headers in results.items()} == \
        {request_id: [request_id] for request_id in ids}
    answers(server)
