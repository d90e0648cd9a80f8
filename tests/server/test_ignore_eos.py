"""``"ignore_eos": true`` (llama-server's and vLLM's field, sent by benchmark clients to fix reply lengths) keeps
end-of-generation tokens from being sampled, on both completion routes, streamed or not, with one slot and with
``--parallel 2``, while concurrent requests without it end where the model ends them.

The model is pushed to end at once with a ``logit_bias`` on its end-of-sequence token: without ``ignore_eos`` the
reply is empty, with it the reply runs to ``max_tokens``.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import httpx
import pytest

from ckpt_plugin.testing.tiny_models import EOS_ID
from support.servers import Server, drop_stream, model_args, run_server

MAX_TOKENS = 24
ENDS_AT_ONCE = {"logit_bias": {str(EOS_ID): 100.0}, "temperature": 0, "max_tokens": MAX_TOKENS}
ROUTES = {"/v1/completions": {"prompt": "Once upon a time"},
          "/v1/chat/completions": {"messages": [{"role": "user", "content": "Tell a story."}]}}


@pytest.fixture(scope="module", params=[1, 2], ids=["one-slot", "parallel-2"])
def server(request: pytest.FixtureRequest, tiny_model: Any) -> Iterator[Server]:
    with run_server(model_args(tiny_model("llama"), parallel=request.param)) as running:
        yield running


def completion_tokens(server: Server, route: str, stream: bool, **extra: Any) -> tuple[int, str]:
    body = {**ROUTES[route], **ENDS_AT_ONCE, **extra}
    if not stream:
        reply = server.post(route, json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["completion_tokens"], reply.json()["choices"][0]["finish_reason"]
    body.update(stream=True, stream_options={"include_usage": True})
    usage, finish = None, None
    with httpx.stream("POST", server.url + route, json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", ()):
                finish = choice.get("finish_reason") or finish
    assert usage is not None
    return usage["completion_tokens"], str(finish)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_ignore_eos_runs_the_reply_to_max_tokens(server: Server, route: str, stream: bool) -> None:
    assert completion_tokens(server, route, stream) == (0, "stop")
    assert completion_tokens(server, route, stream, ignore_eos=True) == (MAX_TOKENS, "length")
    assert completion_tokens(server, route, stream, ignore_eos=False) == (0, "stop")


def test_concurrent_requests_each_keep_their_own_word(server: Server) -> None:
    # A client that leaves mid-stream first: its slot is free again for the others.
    drop_stream(server, ROUTES["/v1/chat/completions"]["messages"], 2, max_tokens=200, timeout=60)
    cases = [(route, stream, ignore) for route in ROUTES for stream in (False, True) for ignore in (False, True)]
    with ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(lambda case: completion_tokens(server, case[0], case[1], ignore_eos=case[2]), cases))
    assert got == [(MAX_TOKENS, "length") if ignore else (0, "stop") for _, _, ignore in cases]


def test_ignore_eos_must_be_a_boolean(server: Server) -> None:
    reply = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "ignore_eos": "yes"})
    assert reply.status_code == 422
    assert "ignore_eos" in reply.json()["error"]["message"]
