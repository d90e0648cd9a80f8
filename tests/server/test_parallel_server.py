"""``ckpt-serve --parallel N`` through real HTTP with concurrent clients: every request answers as plain
``llama_cpp.server`` answers it alone (per-request features included), streams are never interrupted by newer
requests, dropped streams in the middle of a batch free their slot, the queue is bounded (503 past it), tenants
never share state, and ``/slots`` and ``/metrics`` report per slot."""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable, Iterator

import httpx
import pytest

from support.concurrency import all_at_once
from support.near_ties import NEAR_TIE, reference, same_or_near_tie
from support.servers import client, drop_stream, model_args, run_server

BOUND = 90.0
SYSTEMS = [
    "the cat and the dog went to the house " * 8,
    "one two three four five six seven eight nine ten " * 7,
    "is it that this was the one we had in mind " * 7,
]


def conversation(i: int, user: str = "hello") -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEMS[i % len(SYSTEMS)]}, {"role": "user", "content": f"{user} {i}"}]


def chat(server: Any, messages: list[dict[str, str]], stream: bool = False, api_key: str = "none",
         max_tokens: int = 16) -> tuple[str, Any]:
    """The reply's text and usage (``None`` for a stream)."""
    c = client(server, api_key, timeout=BOUND)
    if stream:
        chunks = c.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0,
                                           stream=True)
        return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices), None
    reply = c.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0)
    return reply.choices[0].message.content or "", reply.usage


@pytest.fixture(scope="module")
def parallel(tiny_model: Any) -> Iterator[Any]:
    args = model_args(tiny_model("llama")) + ["--parallel", "3", "--metrics", "true"]
    with run_server(args) as server:
        yield server


def test_concurrent_conversations_answer_as_alone_and_reuse_their_turns(plain: Any, parallel: Any) -> None:
    firsts = [conversation(i) for i in range(6)]
    expected = [reference(plain, m) for m in firsts]
    got = all_at_once([lambda m=m, i=i: chat(parallel, m, stream=i % 2 == 1) for i, m in enumerate(firsts)])
    # Streams included: with --parallel, a newer request never cuts a running stream short.
    assert all(same_or_near_tie(text, want) for (text, _), want in zip(got, expected)), (got, expected)
    seconds = [m + [{"role": "assistant", "content": want[0]}, {"role": "user", "content": "and then?"}]
               for m, want in zip(firsts, expected)]
    expected_second = [reference(plain, m) for m in seconds]
    again = all_at_once([lambda m=m: chat(parallel, m) for m in seconds])
    assert all(same_or_near_tie(text, want) for (text, _), want in zip(again, expected_second))
    # The second turns restore their first turn's prefix (from a slot, a checkpoint or the cache).
    assert all(usage.prompt_tokens_details.cached_tokens > 40 for _, usage in again)


FEATURES: list[dict[str, Any]] = [
    {"prompt": "the cat and the dog", "max_tokens": 8, "logprobs": 3},
    {"prompt": "one two three four", "max_tokens": 6, "echo": True, "logprobs": 2},
    {"prompt": "is it that this was", "max_tokens": 24, "stop": ["the", "a"]},
    {"prompt": "we had the house", "max_tokens": 8, "grammar": 'root ::= "yes" | "no" | "maybe"'},
    {"prompt": "the dog went", "max_tokens": 8, "logit_bias": {"5": 100.0}},
    {"prompt": "ten nine eight", "max_tokens": 8, "temperature": 0.9, "seed": 1234},
    {"prompt": "the cat and the dog", "max_tokens": 8, "stream": True},
]


def completion(server: Any, body: dict[str, Any]) -> Any:
    body = {"temperature": 0.0, **body}
    if body.get("stream"):
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=BOUND) as response:
            assert response.status_code == 200
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        return "".join(json.loads(e)["choices"][0]["text"] for e in events if e != "[DONE]")
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=BOUND)
    assert response.status_code == 200, response.text
    data = response.json()
    choice = data["choices"][0]
    return choice["text"], choice["logprobs"], choice["finish_reason"], data["usage"]["completion_tokens"]


def test_per_request_features_equal_plain_while_other_slots_generate(plain: Any, parallel: Any) -> None:
    expected = [completion(plain, body) for body in FEATURES]
    got = all_at_once([lambda body=body: completion(parallel, body) for body in FEATURES])
    for body, want, have in zip(FEATURES, expected, got):
        if isinstance(want, tuple) and want[1] is not None:
            # logprobs: the same tokens, values within batch numerics
            assert have[0] == want[0] and have[2:] == want[2:], body
            assert have[1]["tokens"] == want[1]["tokens"], body
            for a, b in zip(have[1]["token_logprobs"], want[1]["token_logprobs"]):
                assert (a is None and b is None) or abs(a - b) < NEAR_TIE, body
        else:
            assert have == want, body


def wait_until_idle(server: Any, bound: float = 10.0) -> None:
    """Every slot is free within ``bound`` seconds: a dropped stream's slot is released as soon as the server sees
    its client gone (at its next token), not when a garbage collection happens to reach its generator."""
    deadline = time.monotonic() + bound
    while any(slot["is_processing"] for slot in httpx.get(f"{server.url}/slots", timeout=10).json()):
        assert time.monotonic() < deadline, "a dropped stream kept its slot"
        time.sleep(0.05)


def test_dropped_streams_in_a_batch_free_their_slots(plain: Any, parallel: Any) -> None:
    keep = conversation(7, "keep me")
    expected = reference(plain, keep, max_tokens=48)
    results = all_at_once([
        lambda: drop_stream(parallel, conversation(8, "drop"), 3, max_tokens=200, timeout=BOUND),
        lambda: chat(parallel, keep, stream=True, max_tokens=48)[0],
        lambda: drop_stream(parallel, conversation(9, "drop"), 5, max_tokens=200, timeout=BOUND),
    ])
    assert same_or_near_tie(results[1], expected)
    wait_until_idle(parallel)
    messages = conversation(10, "after the drops")
    started = time.monotonic()
    assert same_or_near_tie(chat(parallel, messages)[0], reference(plain, messages))
    assert time.monotonic() - started < BOUND


def test_slots_and_metrics_report_each_slot(parallel: Any) -> None:
    chat(parallel, conversation(11))
    slots = httpx.get(f"{parallel.url}/slots", timeout=10).json()
    assert [slot["id"] for slot in slots] == [0, 1, 2]
    assert all(slot["n_ctx"] == 2048 and slot["is_processing"] is False for slot in slots)
    assert sum(slot["n_tokens"] for slot in slots) > 40
    text = httpx.get(f"{parallel.url}/metrics", timeout=10).text
    for name in ("ckpt_slot_busy", "ckpt_slot_tokens", "ckpt_slot_checkpoints"):
        assert sum(f'{name}{{model=' in line and 'slot="2"' in line for line in text.splitlines()) == 1, name
    assert httpx.post(f"{parallel.url}/slots", timeout=10).status_code == 405


def test_a_full_queue_answers_503_and_the_rest_answer(tiny_model: Any, plain: Any) -> None:
    args = model_args(tiny_model("llama")) + ["--parallel", "2", "--max-queued", "1"]
    with run_server(args) as server:
        def request(i: int) -> httpx.Response:
            body = {"model": "m", "messages": conversation(i, "busy"), "max_tokens": 200, "temperature": 0}
            return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=BOUND)

        responses = all_at_once([lambda i=i: request(i) for i in range(8)])
        statuses = sorted(r.status_code for r in responses)
        assert set(statuses) <= {200, 503} and statuses.count(200) >= 3 and 503 in statuses, statuses
        for response in responses:
            if response.status_code == 503:
                assert response.json()["error"]["code"] == "server_busy"
        messages = conversation(12, "after the rush")
        assert same_or_near_tie(chat(server, messages)[0], reference(plain, messages))


def test_tenants_never_share_a_slot_state(tiny_model: Any) -> None:
    args = model_args(tiny_model("llama")) + ["--parallel", "2", "--namespaces", "api_key"]
    with run_server(args) as server:
        messages = conversation(13, "secret")
        chat(server, messages, api_key="key-a")
        # the same prompt from another tenant, concurrently with the first tenant's next turn
        (_, b), (_, a) = all_at_once([lambda: chat(server, messages, api_key="key-b"),
                                      lambda: chat(server, messages, api_key="key-a")])
        assert b.prompt_tokens_details.cached_tokens == 0
        assert a.prompt_tokens_details.cached_tokens > 40


def test_concurrent_mixed_routes_with_every_slot_busy(tiny_model: Any, plain: Any, tmp_path: Any) -> None:
    args = model_args(tiny_model("llama")) + ["--parallel", "3", "--admin", "true", "--slot-save-path",
                                              str(tmp_path)]
    statuses: list[tuple[str, int]] = []
    with run_server(args) as server:
        http = httpx.Client(base_url=server.url, timeout=BOUND)

        def chats(i: int) -> None:
            for turn in range(3):
                chat(server, conversation(i, f"mixed {turn}"), stream=turn % 2 == 1)
                drop_stream(server, conversation(i, f"dropped {turn}"), 2, max_tokens=200, timeout=BOUND)

        def admin() -> None:
            for round_ in range(6):
                slot = round_ % 3
                for method, path, body in (
                    ("GET", "/metrics", None), ("GET", "/checkpoints", None), ("GET", "/checkpoints/stats", None),
                    ("GET", "/slots", None), ("POST", f"/slots/{slot}?action=save", {"filename": f"s{slot}.bin"}),
                    ("POST", f"/slots/{slot}?action=restore", {"filename": f"s{slot}.bin"}),
                    ("POST", "/extras/tokenize", {"input": "the cat"}),
                ):
                    response = http.request(method, path, json=body)
                    statuses.append((path, response.status_code))

        all_at_once([lambda i=i: chats(i) for i in range(3)] + [admin])
        assert all(status < 500 for _, status in statuses), [s for s in statuses if s[1] >= 500]
        # a busy slot refuses a file action with 409; an idle one serves it
        assert {status for path, status in statuses if "action=" in path} <= {200, 404, 409}
        messages = conversation(14, "after the storm")
        assert same_or_near_tie(chat(server, messages)[0], reference(plain, messages))
        wait_until_idle(server)


def test_sigterm_with_every_slot_busy_ends_every_stream(tiny_model: Any) -> None:
    import signal

    args = model_args(tiny_model("llama")) + ["--parallel", "2"]
    with run_server(args) as server:
        finished: list[int] = []
        both_streaming = threading.Barrier(2)

        def stream(i: int) -> None:
            body = {"model": "m", "messages": conversation(i, "long"), "max_tokens": 400, "temperature": 0,
                    "stream": True}
            with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=BOUND) as response:
                for n, _ in enumerate(response.iter_lines()):
                    if n == 2:
                        both_streaming.wait(BOUND)  # the signal comes once every slot is busy
                        if i == 0:
                            server.process.send_signal(signal.SIGTERM)
            finished.append(i)

        started = time.monotonic()
        all_at_once([lambda i=i: stream(i) for i in range(2)])
        server.process.wait(timeout=30)
        assert sorted(finished) == [0, 1] and time.monotonic() - started < 60
        assert server.process.returncode in (0, -signal.SIGTERM), "".join(server.log)[-3000:]


def test_parallel_slots_without_flash_attention(tiny_model: Any) -> None:
    """Each slot has a KV stream of its own, so llama.cpp's non-flash attention serves several slots too."""
    args = model_args(tiny_model("llama")) + ["--flash_attn", "false"]
    with run_server(args, plain=True) as plain, run_server(args + ["--parallel", "2"]) as server:
        talks = [conversation(i, "no flash") for i in range(4)]
        replies = all_at_once([lambda m=m: chat(server, m)[0] for m in talks])
        for messages, reply in zip(talks, replies):
            assert same_or_near_tie(reply, reference(plain, messages))


def stats(server: Any) -> dict[str, Any]:
    """The stats of the server's one model."""
    (model,) = httpx.get(f"{server.url}/checkpoints/stats", timeout=BOUND).json()["models"].values()
    return model


@pytest.mark.parametrize("drafting", [["--draft-model", "{model}"], ["--draft_model", "prompt-lookup-decoding"]])
def test_four_concurrent_chats_with_a_draft_answer_as_without_one(tiny_model: Any, drafting: list[str]) -> None:
    """Every slot drafts (from its own sequence of the draft context, or its own prompt lookup decoder): the replies
    are those of the same server without a draft, streams dropped mid-way free their slots, and the next turns
    resume from checkpoints that carry the draft's state."""
    model = str(tiny_model("llama"))
    args = model_args(tiny_model("llama")) + ["--parallel", "4", "--admin", "true"]
    with run_server(args) as plain, run_server(args + [a.format(model=model) for a in drafting]) as server:
        firsts = [conversation(i, "draft") for i in range(4)]
        expected = [chat(plain, m)[0] for m in firsts]
        got = all_at_once([lambda m=m, i=i: chat(server, m, stream=i % 2 == 0)[0] for i, m in enumerate(firsts)])
        assert got == expected
        dropped = all_at_once([
            lambda: drop_stream(server, conversation(5, "drop"), 3, max_tokens=200, timeout=BOUND),
            lambda: chat(server, firsts[1], stream=True)[0],
        ])
        assert dropped[1] == expected[1]
        wait_until_idle(server)
        seconds = [m + [{"role": "assistant", "content": e}, {"role": "user", "content": "and then?"}]
                   for m, e in zip(firsts, expected)]
        want = [chat(plain, m)[0] for m in seconds]
        again = all_at_once([lambda m=m: chat(server, m) for m in seconds])
        assert [text for text, _ in again] == want
        assert all(usage.prompt_tokens_details.cached_tokens > 40 for _, usage in again)
        assert stats(server)["draft_dropped"] == 0


@pytest.mark.parametrize("extra, words", [
    (["--draft-model", "{model}", "--draft_model", "prompt-lookup-decoding"], "choose one"),
    (["--config_file", "{two_models}"], "serves one model"),
    # Images are served on any slot (test_parallel_vision.py), but not with a slot's draft, which would be handed an
    # image's positions as tokens.
    (["--chat_format", "llava-1-5", "--clip_model_path", "{model}", "--draft-model", "{model}"],
     "with clip_model_path and draft-model: parallel slots do not draft for prompts with images"),
    (["--chat_format", "llava-1-5", "--clip_model_path", "{model}", "--draft_model", "prompt-lookup-decoding"],
     "with clip_model_path and --draft_model: parallel slots do not draft for prompts with images"),
])
def test_parallel_refuses_what_it_cannot_serve_in_one_line(tiny_model: Any, tmp_path: Any, extra: list[str],
                                                          words: str) -> None:
    import subprocess
    import sys

    model = str(tiny_model("llama"))
    two_models = tmp_path / "two.yaml"
    two_models.write_text(f"models:\n  - model: {model}\n    model_alias: a\n  - model: {model}\n    model_alias: b\n")
    args = [a.format(model=model, two_models=two_models) for a in extra]
    if "--config_file" not in args:
        args = ["--model", model, *args]
    done = subprocess.run([sys.executable, "-m", "ckpt_plugin_integrations.llama_cpp_server", "--parallel", "2",
                           *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ckpt-serve: ") and words in last and "Traceback" not in done.stderr
