"""No request holds a slot past its use: prompts stop with their client or their time, grammars and prompts that
would cost too much are refused before they run, and an admin deletion never empties a live stream.

Real ckpt-serve processes on the tiny llama model over real HTTP, one slot and ``--parallel 2``. Time is asserted
through counters (tokens evaluated) wherever it can be, and otherwise with bounds far from both sides: each case
used to hold the server for the whole prompt or grammar (tens of seconds); each test ends by checking that a normal
request still answers.
"""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any, Iterator

import httpx
import pytest

from support.servers import model_args, run_server
from test_hardening import BOUND, alive_and_answering, refused

N_CTX = 32768
# About 30,000 tokens: many seconds of evaluation on the tiny model at this context (its attention grows with it).
LONG_PROMPT = "the cat and the dog " * 6000
LONG_PROMPT_TOKENS = 30_000
REQUEST_TIMEOUT = 3  # seconds; the long prompt needs far more
STEP_BUDGET = 0.002  # seconds per grammar sampling step: a plain grammar takes microseconds on this vocabulary


@pytest.fixture(scope="module")
def one_slot(tiny_model: Any) -> Iterator[Any]:
    args = model_args(tiny_model("llama"), n_ctx=N_CTX) + [
        "--request-timeout", str(REQUEST_TIMEOUT), "--grammar-max-step-seconds", str(STEP_BUDGET)]
    with run_server(args) as running:
        yield running


@pytest.fixture(scope="module")
def two_slots(tiny_model: Any) -> Iterator[Any]:
    args = model_args(tiny_model("llama"), n_ctx=N_CTX) + ["--parallel", "2", "--checkpoint-admin", "true"]
    with run_server(args) as running:
        yield running


@pytest.fixture(params=["one_slot", "two_slots"])
def server(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(request.param)


def seconds_until_idle(server: Any, since: float, limit: float = BOUND) -> float:
    """Seconds from ``since`` until no slot is processing (``limit`` if that never happens)."""
    while time.monotonic() - since < limit:
        if not any(slot["is_processing"] for slot in httpx.get(f"{server.url}/slots", timeout=10).json()):
            return time.monotonic() - since
        time.sleep(0.05)
    return limit


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_client_that_leaves_during_its_prompt_frees_the_slot_within_a_batch(server: Any, stream: bool) -> None:
    before = server.metric("tokens_evaluated")
    body = {"prompt": LONG_PROMPT, "max_tokens": 4, "stream": stream}
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):  # the client gives up at 0.5 s, long before the first token
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                          timeout=httpx.Timeout(BOUND, read=0.5)) as response:
            response.read()
    idle = seconds_until_idle(server, started)
    evaluated = server.metric("tokens_evaluated") - before
    # The prompt's evaluation stopped between two batches of 64 tokens: far from its end (the whole prompt was
    # evaluated before, the slot busy for its whole length).
    assert evaluated < LONG_PROMPT_TOKENS / 2, (evaluated, idle)
    assert idle < 20, idle
    alive_and_answering(server)


def test_the_request_timeout_covers_the_prompt(one_slot: Any) -> None:
    before = one_slot.metric("tokens_evaluated")
    started = time.monotonic()
    reply = one_slot.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 4})
    seconds = time.monotonic() - started
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    # As a generation that reaches the timeout: the response ends as if max_tokens was reached, here before a token.
    assert choice["finish_reason"] == "length" and choice["text"] == "", choice
    assert one_slot.metric("tokens_evaluated") - before < LONG_PROMPT_TOKENS / 2
    assert seconds < REQUEST_TIMEOUT + 15, seconds
    alive_and_answering(one_slot)


def alternatives(count: int) -> str:
    rng = random.Random(count)
    return "root ::= " + " | ".join(
        '"' + "".join(rng.choice("abcdefghij") for _ in range(8)) + '"' for _ in range(count))


def test_a_grammar_whose_sampling_step_costs_more_than_the_budget_is_refused(one_slot: Any) -> None:
    # 20,000 alternatives: a sampling step over this model's 347 tokens takes about 15 ms, past the 2 ms budget; on
    # Gemma-3's 262,144 tokens 5,000 alternatives take about 6 s a token (docs/server.md, "Limits").
    body = {"prompt": "hi", "max_tokens": 2, "grammar": alternatives(20_000), "stream": True}
    error = refused(one_slot.post("/v1/completions", json=body), 422, "invalid_grammar")
    assert "sampling step" in error["message"] and "grammar_max_step_seconds" in error["message"], error
    # A plain grammar is far within the budget, and is used.
    reply = one_slot.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0,
                                                   "grammar": 'root ::= "a"+'})
    assert reply.status_code == 200, reply.text
    assert set(reply.json()["choices"][0]["text"]) <= {"a"}
    alive_and_answering(one_slot)


ABSURD_SCHEMAS = [
    {"type": "string", "minLength": 100_000_000},
    {"type": "array", "minItems": 50_000_000},
    # Each bound alone is modest; together they ask for 9 million characters.
    {"type": "array", "minItems": 3000, "items": {"type": "string", "minLength": 3000}},
    {"type": "object", "properties": {"a": {"type": "object", "minProperties": 10_000_000}}},
]


@pytest.mark.parametrize("schema", ABSURD_SCHEMAS, ids=["minLength", "minItems", "nested", "minProperties"])
def test_a_schema_whose_size_bounds_cannot_fit_the_context_is_refused_at_once(server: Any, schema: Any) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": {"type": "json_object", "schema": schema}}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    tools = {"messages": body["messages"], "max_tokens": 4, "tools": [tool],
             "tool_choice": {"type": "function", "function": {"name": "f"}}}
    for request in (body, tools):
        started = time.monotonic()
        error = refused(server.post("/v1/chat/completions", json=request), 422, "invalid_grammar")
        # Without compiling: the conversion alone writes minLength 10^8 out as a 500 MB grammar (10 s, then refused
        # when the check's time ran out). About 30 ms here; the bound is far from both.
        assert time.monotonic() - started < 5
        assert "size bounds" in error["message"] and f"context of {N_CTX} tokens" in error["message"], error
    alive_and_answering(server)


def test_a_schema_within_the_context_is_served(one_slot: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 3}}, "required": ["a"]}
    reply = one_slot.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_object", "schema": schema}})
    assert reply.status_code == 200, reply.text


def test_compiling_past_the_check_budget_is_refused_and_the_next_grammar_is_checked(tiny_model: Any) -> None:
    # 20,000 alternatives take about 0.5 s to compile here (100,000 take 12 s), a plain grammar about 1 ms.
    args = model_args(tiny_model("llama")) + ["--grammar-check-seconds", "0.1"]
    with run_server(args) as server:
        body = {"prompt": "hi", "max_tokens": 2, "grammar": alternatives(20_000)}
        error = refused(server.post("/v1/completions", json=body), 422, "invalid_grammar")
        assert "grammar_check_seconds" in error["message"], error  # the budget's word, not the compiler's
        # The child that was stopped mid-compilation is replaced: a small grammar compiles and is used.
        reply = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0,
                                                     "grammar": 'root ::= "b"+'})
        assert reply.status_code == 200, reply.text
        assert set(reply.json()["choices"][0]["text"]) <= {"b"}
        alive_and_answering(server)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(server: Any, route: str) -> None:
    text = "the cat and the dog " * 1_000_000  # 20 MB: the host tokenized it for 32-41 s before refusing it
    body: dict[str, Any] = ({"prompt": text} if route == "/v1/completions"
                            else {"messages": [{"role": "user", "content": text}]})
    started = time.monotonic()
    error = refused(server.post(route, json={**body, "max_tokens": 2}), 400, "context_length_exceeded")
    assert f"context of {N_CTX} tokens" in error["message"], error
    assert time.monotonic() - started < 20
    alive_and_answering(server)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_context_error_on_parallel_slots_names_a_slots_context(two_slots: Any, stream: bool) -> None:
    # Over 32,768 tokens but not so many bytes that it is refused unread: the host's own check answers.
    body = {"prompt": "the cat and the dog " * 7000, "max_tokens": 2, "stream": stream}
    if not stream:
        error = refused(two_slots.post("/v1/completions", json=body), 400)
        assert f"maximum context length is {N_CTX} tokens" in error["message"], error
    else:
        with httpx.stream("POST", f"{two_slots.url}/v1/completions", json=body, timeout=BOUND) as response:
            events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert f"exceed context window of {N_CTX}" in json.loads(events[-2])["error"]["message"], events[-2]
    alive_and_answering(two_slots)


def test_deleting_checkpoints_waits_for_the_streams_using_the_slots(two_slots: Any) -> None:
    server = two_slots
    assert httpx.delete(f"{server.url}/checkpoints", timeout=BOUND).status_code == 200  # cold slots, empty cache
    # Long enough to be mid-stream when the DELETE comes (a few ms a token here), short enough to wait for.
    body = {"max_tokens": 600, "temperature": 1.0, "seed": 7, "stop": [], "stream": True,
            "stream_options": {"include_usage": True}}
    usages: list[dict[str, Any]] = []
    started = [threading.Event(), threading.Event()]

    def stream(index: int) -> None:
        # Prompts that share no prefix: each stream evaluates its own once.
        prompt = f"{'dog' if index else 'cat'} " + "the cat and the dog " * 100
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "prompt": prompt},
                          timeout=BOUND) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    started[index].set()
                    chunk = json.loads(line[len("data: "):])
                    if chunk.get("usage"):
                        usages.append(chunk["usage"])
        started[index].set()

    before = server.metric("tokens_evaluated")
    threads = [threading.Thread(target=stream, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(BOUND)
    busy = [slot["is_processing"] for slot in httpx.get(f"{server.url}/slots", timeout=10).json()]
    deleted = httpx.delete(f"{server.url}/checkpoints", timeout=BOUND)
    for thread in threads:
        thread.join(BOUND)
    assert deleted.status_code == 200, deleted.text
    assert busy == [True, True], busy  # the streams were live when the DELETE came
    assert len(usages) == 2
    # No stream evaluated its context again: the tokens evaluated are the two prompts and every generated token but
    # the last of each. Emptied under them, each stream evaluated its whole context again at its next token.
    needed = sum(usage["prompt_tokens"] + usage["completion_tokens"] - 1 for usage in usages)
    evaluated = server.metric("tokens_evaluated") - before
    assert needed - 4 <= evaluated <= needed, (evaluated, needed, usages, deleted.json())
    # Then it deleted what the streams left: both slots are empty, and said so.
    assert deleted.json()["tiers"]["slot"] == 2, deleted.json()
    assert [slot["n_tokens"] for slot in httpx.get(f"{server.url}/slots", timeout=10).json()] == [0, 0]
    alive_and_answering(server)
