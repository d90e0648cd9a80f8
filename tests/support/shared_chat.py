"""Chat turns against ckpt-serve replicas that share a tier (Redis, Valkey, a cluster), for the tests of
tests/server: the replicas' arguments, a turn and the wait for its state to reach the shared tier."""

from __future__ import annotations

import time
from typing import Any

import openai

from support.servers import Server, model_args

MAX_TOKENS = 4
SYSTEMS = [
    "the cat and the dog went to the house " * 12,
    "one two three four five six seven eight nine ten " * 10,
]
USERS = ["hello world", "and then the dog", "what is it", "one more time"]


def shared_args(path: Any, url: str, prefix: str, *extra: str) -> list[str]:
    # Checkpoints every 32 tokens make restore points inside these short prompts on every memory kind. Answers are
    # compared exactly, so without flash attention, whose rounding depends on how the cache was filled (it is
    # covered by the property tests, tests/engine/test_equivalence.py, with a near-tie allowance). Cached tokens are
    # asserted, so plans keep the most tokens: by cost, a tiny model evaluates so fast that whether a fetch from the
    # tier pays depends on the machine's timing at that moment (plans by cost over a shared tier:
    # tests/unit/test_slow_tier.py).
    return model_args(path, flash_attn="false") + ["--checkpoint-redis-url", url, "--checkpoint-redis-prefix", prefix,
                               "--checkpoint-redis-retry", "0.2", "--checkpoint-min-step", "32",
                               "--checkpoint-namespaces", "api_key", "--plan-by-cost", "false", *extra]


def chat(server: Server, messages: list[dict[str, str]], key: str = "tenant-a") -> Any:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)
    return client.chat.completions.create(model="m", messages=messages, max_tokens=MAX_TOKENS, temperature=0)


def written(server: Server, before: float, timeout: float = 15.0) -> None:
    """Wait until ``server`` wrote an entry to the shared tier since its counter read ``before`` (the write happens
    after the response, on the write-behind thread)."""
    deadline = time.monotonic() + timeout
    while server.metric("shared_writes_total") <= before:
        assert time.monotonic() < deadline, "no entry reached the shared tier"
        time.sleep(0.05)


def served(server: Server, messages: list[dict[str, str]], key: str = "tenant-a") -> Any:
    """Send a turn and wait until its state is in the shared tier."""
    before = server.metric("shared_writes_total")
    response = chat(server, messages, key)
    written(server, before)
    return response


def cached(response: Any) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def content(response: Any) -> str:
    return response.choices[0].message.content
