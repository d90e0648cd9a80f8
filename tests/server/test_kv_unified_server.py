"""``ckpt-serve --parallel 4`` through real HTTP, with and without ``--kv-unified true``: four clients sending the
same new long prefix together evaluate it once (the others share its cells in the pool, or restore the state the
first one parked in the cache), and every answer equals the same request on a fresh context at temperature 0."""

from __future__ import annotations

from typing import Any, Iterator

import httpx
import numpy as np
import pytest

from support.servers import Server, client, model_args, run_server
from test_parallel_server import all_at_once

BOUND = 90.0
OPTIONS = {"n_ctx": 2048, "n_batch": 64, "n_ubatch": 64, "n_threads": 2, "seed": 0}


@pytest.fixture(scope="module", params=[True, False], ids=["kv-unified", "streams"])
def served(request: pytest.FixtureRequest, tiny_model: Any) -> Iterator[tuple[Server, bool]]:
    """The server, and whether its slots share one pool of cells."""
    args = model_args(tiny_model("llama"), **OPTIONS) + ["--parallel", "4", "--admin", "true"]
    with run_server(args + ["--kv-unified", "true"] if request.param else args) as server:
        yield server, request.param


def counters(server: Server) -> dict[str, Any]:
    (model,) = httpx.get(f"{server.url}/checkpoints/stats", timeout=BOUND).json()["models"].values()
    return model


def test_four_clients_with_one_new_prefix_evaluate_it_once(tiny_model: Any, served: tuple[Server, bool]) -> None:
    from llama_cpp import Llama

    server, unified = served
    rng = np.random.default_rng(37)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa"]
    system = " ".join(rng.choice(words, 80))  # ~380 tokens, new to the server
    conversations = [[{"role": "system", "content": system}, {"role": "user", "content": f"question {i} {words[i]}"}]
                     for i in range(4)]
    fresh = Llama(model_path=str(tiny_model("llama")), flash_attn=True, verbose=False, **OPTIONS)
    try:
        expected = []
        for messages in conversations:
            fresh.reset()  # a fresh context: nothing of the previous request is reused
            reply = fresh.create_chat_completion(messages, max_tokens=16, temperature=0)
            expected.append(reply["choices"][0]["message"]["content"] or "")
        n_system = len(fresh.tokenize(system.encode(), add_bos=False))
    finally:
        fresh.close()
    before = counters(server)

    def ask(messages: list[dict[str, str]]) -> tuple[str, Any]:
        reply = client(server, timeout=BOUND).chat.completions.create(
            model="m", messages=messages, max_tokens=16, temperature=0)
        return reply.choices[0].message.content or "", reply.usage

    replies = all_at_once([lambda messages=messages: ask(messages) for messages in conversations])
    assert [text for text, _ in replies] == expected
    after = counters(server)
    delta = {key: after[key] - before[key] for key in ("prompt_tokens", "tokens_reused", "kv_shares",
                                                         "tokens_shared", "prefix_waits", "cache_hits")}
    assert delta["prompt_tokens"] == sum(usage.prompt_tokens for _, usage in replies)
    # The system prompt evaluated once: the three other requests took its cells (its text's tokens, less a few
    # where the template joins it to what follows).
    evaluated = delta["prompt_tokens"] - delta["tokens_reused"]
    assert evaluated <= delta["prompt_tokens"] - 3 * (n_system - 4), (delta, n_system)
    # How the others got it depends on when each arrived: waiting for the first (prefix_waits), then its cells
    # (pool) or the state it parked (streams); or, arriving after it ended, its slot's memory.
    if not unified:
        assert delta["kv_shares"] == 0, delta
    cached = sorted(usage.prompt_tokens_details.cached_tokens for _, usage in replies)
    assert cached[0] == 0 and all(c >= n_system - 4 for c in cached[1:]), cached
