"""``GET /health`` of ckpt-serve, as llama.cpp's llama-server answers it: ``{"status": "ok"}`` once the model is
loaded, 503 ``Loading model`` while one loads, and with ``?fail_on_no_slot=1`` 503 ``no slot available`` while every
slot is busy (also on ``/slots``). It answers at once while every slot generates and while a request waits for the
model lock: checked by order, never by time (a 503 ``no slot available`` before and after an answer shows that every
slot was busy while it was made). It is public and the same for every tenant."""

from __future__ import annotations

import threading
from typing import Any, Iterator

import httpx
import pytest
from starlette.applications import Starlette

from ckpt_plugin.http.middleware import CheckpointMiddleware
from ckpt_plugin.testing.waiting import wait_until
from support.apps import serve
from support.busy import BOUND, HEALTH_NO_SLOT, no_slot_free, slots_held
from support.near_ties import reference, same_or_near_tie
from support.servers import client, model_args, run_server

OK = {"status": "ok"}
LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}


def chat(server: Any, messages: list[dict[str, str]], max_tokens: int = 16, api_key: str = "none") -> str:
    reply = client(server, api_key, timeout=BOUND).chat.completions.create(
        model="m", messages=messages, max_tokens=max_tokens, temperature=0)
    return reply.choices[0].message.content or ""


@pytest.fixture(scope="module")
def two_slots(tiny_model: Any) -> Iterator[Any]:
    with run_server(model_args(tiny_model("llama")) + ["--parallel", "2"]) as server:
        yield server


@pytest.fixture(scope="module")
def one_slot(tiny_model: Any) -> Iterator[Any]:
    with run_server(model_args(tiny_model("llama"))) as server:
        yield server


def test_health_answers_as_llama_server(two_slots: Any) -> None:
    with httpx.Client(base_url=two_slots.url, timeout=BOUND) as http:
        for path in ("/health", "/v1/health", "/health?fail_on_no_slot=1", "/health?fail_on_no_slot=",
                     "/health?other=1"):
            response = http.get(path)
            assert response.status_code == 200 and response.json() == OK, (path, response.text)
            assert response.headers["content-type"] == "application/json"
        head = http.head("/health")
        assert head.status_code == 200 and head.content == b""
        for method in ("POST", "PUT", "DELETE"):
            refused = http.request(method, "/health")
            assert refused.status_code == 405 and refused.headers["allow"] == "GET, HEAD"
            assert refused.json()["error"]["code"] == "method_not_allowed"
        slots = http.get("/slots?fail_on_no_slot=1")
        assert slots.status_code == 200 and [slot["id"] for slot in slots.json()] == [0, 1]


def test_health_answers_while_every_slot_generates(two_slots: Any, plain: Any) -> None:
    with httpx.Client(base_url=two_slots.url, timeout=BOUND) as http:
        with slots_held(two_slots, 2) as held:
            assert all(stream.started.is_set() for stream in held)
            for path in ("/health", "/v1/health"):
                answer = http.get(path)
                assert answer.status_code == 200 and answer.json() == OK
            slots = http.get("/slots?fail_on_no_slot=1")
            assert slots.status_code == 503 and slots.json() == HEALTH_NO_SLOT
            # Still no slot free after those answers: they were made while both slots generated.
            assert no_slot_free(two_slots)
            assert not any(stream.ended for stream in held)
        # The held streams disconnected: their slots free up, and the next request answers as it would alone.
        wait_until(lambda: not no_slot_free(two_slots), BOUND, message="a dropped stream kept its slot")
        messages = [{"role": "user", "content": "after the long stories"}]
        assert same_or_near_tie(chat(two_slots, messages), reference(plain, messages))


def test_health_answers_while_a_request_waits_for_the_model_lock(one_slot: Any, plain: Any) -> None:
    with httpx.Client(base_url=one_slot.url, timeout=BOUND) as http:
        messages = [{"role": "user", "content": "waiting for my turn"}]
        waiting: dict[str, Any] = {}

        def wait_for_the_lock() -> None:
            waiting["reply"] = chat(one_slot, messages)

        with slots_held(one_slot, 1):
            # One slot, served under the host's lock: this request waits for it while the held stream generates.
            waiter = threading.Thread(target=wait_for_the_lock, daemon=True)
            waiter.start()
            for _ in range(3):
                answer = http.get("/health")
                assert answer.status_code == 200 and answer.json() == OK
                assert no_slot_free(one_slot)
            assert "reply" not in waiting  # it still waits: the answers above did not
        waiter.join(BOUND)
        assert same_or_near_tie(waiting["reply"], reference(plain, messages))
        assert not no_slot_free(one_slot)


def test_health_is_public_and_says_nothing_of_tenants(tiny_model: Any) -> None:
    args = model_args(tiny_model("llama")) + ["--parallel", "2", "--api_key", "tenant-key", "--admin-key", "op-key",
                                              "--namespaces", "api_key"]
    with run_server(args) as server:
        with httpx.Client(base_url=server.url, timeout=BOUND) as http:
            keys = [None, "tenant-key", "op-key", "wrong-key"]

            def answers() -> list[tuple[int, bytes]]:
                found = []
                for key in keys:
                    headers = {"Authorization": f"Bearer {key}"} if key else {}
                    for path in ("/health", "/health?fail_on_no_slot=1"):
                        response = http.get(path, headers=headers)
                        found.append((response.status_code, response.content))
                return found

            before = answers()
            assert before == [(200, b'{"status":"ok"}')] * len(before)
            chat(server, [{"role": "user", "content": "my secret"}], api_key="tenant-key")
            # A tenant's state in a slot changes nothing /health says, to anyone.
            assert answers() == before
            # The rest of the server still wants the key.
            assert http.get("/v1/models").status_code == 401


def test_health_answers_503_while_the_model_loads() -> None:
    state = {"loaded": False}
    app = Starlette()
    app.add_middleware(CheckpointMiddleware, managers={}, loaded=lambda: state["loaded"])
    with serve(app) as url:
        loading = httpx.get(f"{url}/health", timeout=BOUND)
        assert loading.status_code == 503 and loading.json() == LOADING
        assert httpx.get(f"{url}/health?fail_on_no_slot=1", timeout=BOUND).json() == LOADING
        state["loaded"] = True
        assert httpx.get(f"{url}/v1/health", timeout=BOUND).json() == OK
        # No slot at all (no model attached): none is free.
        no_slot = httpx.get(f"{url}/health?fail_on_no_slot=1", timeout=BOUND)
        assert no_slot.status_code == 503 and no_slot.json() == HEALTH_NO_SLOT
