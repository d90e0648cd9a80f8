"""docs/server.md's deployment recipe, run: vllm-router 0.1.17 (unmodified, from PyPI) with its cache_aware policy in
front of two real ckpt-serve replicas, with and without a shared redis-server.

The router starts once both replicas answer ``GET /health``, asks each replica for every request's prompt in token
ids (``POST /v1/chat/completions/render``) and keeps a conversation where its prefix is: every turn after the first
reuses the conversation's state, none is refused.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import httpx
import pytest

from ckpt_plugin.testing.routers import router_binary, run_router

from support.redis_servers import RedisServer
from support.servers import Server, model_args, run_server

pytestmark = pytest.mark.skipif(router_binary() is None,
                                reason="vllm-router is not installed (pip install vllm-router==0.1.17)")

SYSTEM = "one two three four five six seven eight nine ten "
USERS = ["hello world", "and then the dog", "what is it"]


@contextlib.contextmanager
def replicas(path: Any, redis_url: str | None) -> Iterator[tuple[Server, Server]]:
    args = model_args(path, model_alias="m")
    if redis_url is not None:
        args += ["--redis-url", redis_url, "--redis-prefix", "router", "--plan-by-cost", "false"]
    with run_server(args) as a, run_server(args) as b:
        yield a, b


def served_by(replicas: tuple[Server, Server]) -> list[float]:
    return [server.metric("prompts_total") for server in replicas]


def conversations(router_url: str, servers: tuple[Server, Server]) -> list[dict[str, Any]]:
    """4 users x 3 turns through the router, one request at a time; each turn's replica, prompt and cached tokens."""
    users = [[{"role": "system", "content": f"user {user}: " + SYSTEM * 8}] for user in range(4)]
    turns = []
    for turn in range(len(USERS)):
        for user, messages in enumerate(users):
            messages.append({"role": "user", "content": USERS[turn]})
            before = served_by(servers)
            response = httpx.post(f"{router_url}/v1/chat/completions", timeout=120,
                                  json={"model": "m", "messages": messages, "max_tokens": 4, "temperature": 0})
            assert response.status_code == 200, response.text
            body = response.json()
            after = served_by(servers)
            replica = next(i for i in (0, 1) if after[i] > before[i])
            turns.append({"user": user, "turn": turn, "replica": replica,
                          "prompt": body["usage"]["prompt_tokens"],
                          "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"]})
            messages.append(body["choices"][0]["message"])
    return turns


def moved(turns: list[dict[str, Any]]) -> int:
    """Turns served by another replica than the user's previous turn."""
    last: dict[int, int] = {}
    count = 0
    for turn in turns:
        count += turn["user"] in last and last[turn["user"]] != turn["replica"]
        last[turn["user"]] = turn["replica"]
    return count


@pytest.mark.parametrize("shared", [True, False], ids=["redis", "no-redis"])
def test_cache_aware_keeps_each_conversation_where_its_prefix_is(shared: bool, tiny_model: Any,
                                                                 redis_server: RedisServer) -> None:
    with replicas(tiny_model("llama"), redis_server.url if shared else None) as servers:
        with run_router([s.url for s in servers], "cache_aware") as router:
            turns = conversations(router.url, servers)
            text = router.text()
    later = [t for t in turns if t["turn"] > 0]
    assert "Cache prefix decision" in text, "the router used the render route for its decisions"
    assert "render_unavailable" not in text
    assert moved(turns) <= 1, turns
    # every later turn reuses all of its prompt but the new user message
    previous = {t["user"]: t["prompt"] for t in turns if t["turn"] == 0}
    for turn in later:
        assert turn["cached"] >= previous[turn["user"]], turn
        previous[turn["user"]] = turn["prompt"]
