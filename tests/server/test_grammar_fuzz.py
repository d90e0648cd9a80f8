"""Grammars with dead ends at random depths, over every route that samples with one, on a real ckpt-serve with one
slot and with ``--parallel 2``: the server process stays alive through all of them.

A dead end is a point where the grammar matches nothing (an inverted range, a character no token of the model
holds), reached after a literal of random length. The grammar check before the request finds some of them (422
before any token); the sampler finds every other one when the generation gets there: a request that is not streamed
gets 422 ``invalid_grammar``, a stream that started ends with an error event of code 422, and a reply that
``max_tokens`` ends first finishes normally. Never a 500, never a dead process; after the run, the same plain request
answers as it did before.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.servers import Server, model_args, run_server

EXAMPLES = int(os.environ.get("CKPT_GRAMMAR_FUZZ_EXAMPLES", "40"))
ALIAS = "/v1/engines/copilot-codex/completions"
DEAD_PIECES = ("[z-a]", "[b-a]", "[9-0]", '"\u20ac\u20ac"', '"a" [y-b]')
JSON_DEAD_PIECES = ("[z-a]", "[b-a]", "[9-0]")
ROUTES = ("completion", "alias", "chat", "response_format", "tool")
CHAT = [{"role": "user", "content": "Say something."}]
REFERENCE = {"prompt": "The fuzz is over.", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module", params=[1, 2], ids=["one-slot", "parallel-2"])
def server(request: pytest.FixtureRequest, tiny_model: Any) -> Iterator[Server]:
    with run_server(model_args(tiny_model("llama"), parallel=request.param),
                    env={"GGML_NO_BACKTRACE": "1"}) as running:
        yield running


def literal(text: str) -> str:
    return json.dumps(text)


def body_for(route: str, prefix: str, dead: str, max_tokens: int, stream: bool) -> tuple[str, dict[str, Any]]:
    grammar = f"root ::= {literal(prefix)} {dead}" if prefix else f"root ::= {dead}"
    common = {"max_tokens": max_tokens, "stream": stream, "temperature": 0.7}
    if route in ("completion", "alias"):
        path = "/v1/completions" if route == "completion" else ALIAS
        return path, {"prompt": "Write:", "grammar": grammar, **common}
    if route == "chat":
        return "/v1/chat/completions", {"messages": CHAT, "grammar": grammar, **common}
    pattern = "^" + "".join(c if c.isalnum() else "\\" + c for c in prefix) + dead + "$"
    schema = {"type": "object", "properties": {"text": {"type": "string", "pattern": pattern}}, "required": ["text"]}
    if route == "response_format":
        return "/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_object", "schema": schema},
                                        **common}
    tool = {"type": "function", "function": {"name": "write", "parameters": schema}}
    return "/v1/chat/completions", {"messages": CHAT, "tools": [tool],
                                    "tool_choice": {"type": "function", "function": {"name": "write"}}, **common}


def check_plain(response: httpx.Response) -> str:
    if response.status_code == 422:
        assert response.json()["error"]["code"] == "invalid_grammar", response.text
        return "refused"
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls"), response.text
    return "finished"


def check_stream(server: Server, path: str, body: dict[str, Any]) -> str:
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as response:
        if response.status_code == 422:
            response.read()
            assert response.json()["error"]["code"] == "invalid_grammar", response.text
            return "refused"
        assert response.status_code == 200
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    last = json.loads(events[-2])
    if "error" in last:
        assert last["error"]["code"] == 422 and last["error"]["type"] == "invalid_grammar", last
        return "cut at the dead end"
    assert last["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls"), last
    return "finished"


def test_dead_ends_at_any_depth_never_kill_the_server(server: Server) -> None:
    reference = server.post("/v1/completions", json=REFERENCE)
    assert reference.status_code == 200
    outcomes: dict[str, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(route=st.sampled_from(ROUTES), prefix=st.text(alphabet="abcde xyz", max_size=120),
           dead_index=st.integers(0, len(DEAD_PIECES) - 1), max_tokens=st.integers(4, 300), stream=st.booleans())
    def one(route: str, prefix: str, dead_index: int, max_tokens: int, stream: bool) -> None:
        pieces = DEAD_PIECES if route in ("completion", "alias", "chat") else JSON_DEAD_PIECES
        path, body = body_for(route, prefix, pieces[dead_index % len(pieces)], max_tokens, stream)
        if stream:
            outcome = check_stream(server, path, body)
        else:
            outcome = check_plain(server.post(path, json=body))
        assert server.process.poll() is None, "".join(server.log[-40:])
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    one()
    print("grammar fuzz outcomes:", outcomes)
    # Both ends were reached: refused before any token, and cut where the generation met the dead end.
    assert outcomes.get("refused", 0) and outcomes.get("cut at the dead end", 0), outcomes
    again = server.post("/v1/completions", json=REFERENCE)
    assert again.status_code == 200
    assert again.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]


def test_a_dead_end_deeper_than_the_check_looks_gets_422_on_both_completion_routes(server: Server) -> None:
    grammar = ('root ::= "The quick brown fox jumps over the lazy dog and keeps running across the wide green field '
               'toward the river" [z-a]')
    for path, body in (("/v1/completions", {"prompt": "Write:"}), ("/v1/chat/completions", {"messages": CHAT})):
        response = server.post(path, json={**body, "grammar": grammar, "max_tokens": 300})
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["code"] == "invalid_grammar" and "generated tokens" in error["message"], error
        assert check_stream(server, path, {**body, "grammar": grammar, "max_tokens": 300, "stream": True}) \
            == "cut at the dead end"
    assert server.process.poll() is None
    assert server.post("/v1/completions", json=REFERENCE).status_code == 200
