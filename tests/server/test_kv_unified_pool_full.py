"""``ckpt-serve --parallel N --kv-unified true`` with a pool too small for what its busy slots ask, through real HTTP.

Prompts that do not fit beside running generations wait for cells (a slot whose request ends is freed); when the
running generations themselves outgrow the pool, one of them is refused with a 503 and a JSON body (``server_busy``,
``Retry-After``), never a 500, and the others go on to their end.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from support.servers import model_args, run_server
from test_parallel_server import BOUND, all_at_once, chat, conversation, reference, same_or_near_tie

POOL = 512
GENERATED = 480  # each reply alone fits a slot's 512 positions; two of them are far more than the pool


def eos_of(path: Any) -> int:
    from llama_cpp import Llama

    vocab = Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        return int(vocab.token_eos())
    finally:
        vocab.close()


def test_prompts_that_overfill_the_pool_answer_or_get_503_and_the_server_goes_on(tiny_model: Any, plain: Any) -> None:
    args = model_args(tiny_model("llama"), n_ctx=POOL) + ["--parallel", "4", "--kv-unified", "true"]
    conversations = [conversation(i, "tell me more " * 6) for i in range(3)] + [conversation(3, "and again " * 9)]
    expected = [reference(plain, messages) for messages in conversations]
    with run_server(args) as server:
        def ask(messages: list[dict[str, str]]) -> httpx.Response:
            body = {"model": "m", "messages": messages, "max_tokens": 16, "temperature": 0}
            return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=BOUND)

        responses = all_at_once([lambda messages=messages: ask(messages) for messages in conversations])
        answered = [(r.json(), want) for r, want in zip(responses, expected) if r.status_code == 200]
        used = sum(reply["usage"]["total_tokens"] for reply, _ in answered)
        statuses = [r.status_code for r in responses]
        # More than the pool holds: prompts wait for cells while generations run, and what cannot get any is
        # refused with a 503 the client can retry, never a 500.
        assert set(statuses) <= {200, 503} and len(answered) >= 2, statuses
        assert used > POOL or 503 in statuses, (used, statuses)
        for reply, want in answered:
            assert same_or_near_tie(reply["choices"][0]["message"]["content"] or "", want)
        for response in responses:
            if response.status_code == 503:
                assert response.json()["error"]["code"] == "server_busy" and response.headers["retry-after"] == "1"
        for messages, want in zip(conversations, expected):  # everything answers once the rush is over
            assert same_or_near_tie(chat(server, messages)[0], want)


def test_generations_that_outgrow_the_pool_refuse_one_with_503_and_the_other_ends(tiny_model: Any,
                                                                                 plain: Any) -> None:
    path = tiny_model("llama")
    args = model_args(path, n_ctx=POOL) + ["--parallel", "2", "--kv-unified", "true"]
    no_end = {str(eos_of(path)): -100}
    with run_server(args) as server:
        def long_stream() -> tuple[int, str, int]:
            body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": GENERATED, "temperature": 0,
                    "stream": True, "logit_bias": no_end, "stream_options": {"include_usage": True}}
            text, generated = "", 0
            with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=BOUND) as response:
                for line in response.iter_lines():
                    text += line + "\n"
                    if '"usage"' in line and '"completion_tokens"' in line:
                        generated = int(line.split('"completion_tokens":')[1].split(",")[0].split("}")[0])
                return response.status_code, text, generated

        def long_reply() -> httpx.Response:
            body = {"model": "m", "messages": [{"role": "user", "content": "and then"}], "max_tokens": GENERATED,
                    "temperature": 0, "logit_bias": no_end}
            return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=BOUND)

        (status, stream, generated), response = all_at_once([long_stream, long_reply])
        # Prompts of a few tokens fit beside each other whenever the second arrives (before the first is 468 tokens
        # in), and together the two replies need far more than the pool: one generation is refused (the longer one
        # when the pool ran out, whichever that was) and the other runs to its end.
        assert status == 200
        stream_refused = '"error"' in stream
        assert stream_refused != (response.status_code == 503), (stream[-500:], response.text)
        if stream_refused:
            event = json.loads(stream.split("data: ")[-2].strip())
            assert event["error"]["code"] == 503 and "cells the slots share" in event["error"]["message"], event
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == GENERATED
        else:
            assert generated == GENERATED, stream[-500:]
            assert response.headers["retry-after"] == "1"
            error = response.json()["error"]
            assert error["code"] == "server_busy" and "cells the slots share" in error["message"], error
        # The server still answers, and correctly.
        messages = conversation(2, "after the overflow")
        assert same_or_near_tie(chat(server, messages)[0], reference(plain, messages))
