"""Two real ckpt-serve replicas on 127.0.0.1 sharing one real redis-server: a conversation moves between them at
every turn and answers as a fresh context does (plain llama_cpp.server), with ``cached_tokens`` covering the shared
prefix; branches and regenerations too, on plain, sliding-window, recurrent and hybrid models; tenants stay apart;
and a server that dies, comes back, hangs, fills up or serves garbage never costs a correct, prompt answer."""

from __future__ import annotations

import time
from typing import Any, Iterator

import httpx
import pytest

from ckpt_plugin.persist import decode_entry

from support.redis_servers import RedisServer, run_redis
from support.servers import Server, model_args, run_server
from support.shared_chat import SYSTEMS, USERS, cached, chat, content, served, shared_args

@pytest.fixture(scope="module", params=["llama", "gemma3", "mamba", "hybrid"])
def replicas(request: pytest.FixtureRequest, tiny_model: Any, redis_server: RedisServer) -> Iterator[Any]:
    """Replicas A and B of one model on the shared server, and the plain server that answers as a fresh context."""
    kind = request.param
    path = tiny_model(kind)
    args = shared_args(path, redis_server.url, kind)
    with run_server(args) as a, run_server(args) as b, run_server(model_args(path, flash_attn="false"), plain=True) as plain:
        yield kind, a, b, plain


def test_a_conversation_moves_to_the_other_replica_at_every_turn(replicas: Any) -> None:
    kind, a, b, plain = replicas
    slack = 0 if kind == "llama" else 1  # a checkpoint restores from one token before the previous prompt's end
    conversations = [[{"role": "system", "content": system}] for system in SYSTEMS]
    previous: dict[int, int] = {}
    hits_before = a.metric("shared_hits_total") + b.metric("shared_hits_total")
    for turn in range(3):
        for user, messages in enumerate(conversations):
            messages.append({"role": "user", "content": USERS[(turn + user) % len(USERS)]})
            replica = (a, b)[(turn + user) % 2]  # never the replica that served this user's previous turn
            response = served(replica, messages)
            assert content(response) == content(chat(plain, messages)), (kind, turn, user)
            if turn:
                assert cached(response) >= previous[user] - slack, (kind, turn, user, cached(response))
            previous[user] = response.usage.prompt_tokens
            messages.append({"role": "assistant", "content": content(response)})
    hits = a.metric("shared_hits_total") + b.metric("shared_hits_total") - hits_before
    assert hits >= 4, hits
    assert a.metric("shared_errors_total") == b.metric("shared_errors_total") == 0


def test_branches_and_regenerations_on_the_other_replica(replicas: Any) -> None:
    kind, a, b, plain = replicas
    messages = [{"role": "system", "content": SYSTEMS[0] + " branch"}, {"role": "user", "content": USERS[0]}]
    first = served(a, messages)
    messages += [{"role": "assistant", "content": content(first)}, {"role": "user", "content": USERS[1]}]
    second = served(a, messages)
    # regenerate the last answer elsewhere: everything but the last prompt token is restored
    again = chat(b, messages)
    assert content(again) == content(second) == content(chat(plain, messages))
    assert cached(again) >= second.usage.prompt_tokens - 1, cached(again)
    # edit the first user message elsewhere: the system prompt comes back from a checkpoint (or a truncation)
    edited = [messages[0], {"role": "user", "content": USERS[2]}]
    branch = chat(b, edited)
    assert content(branch) == content(chat(plain, edited))
    assert cached(branch) >= first.usage.prompt_tokens - 40, (kind, cached(branch), first.usage.prompt_tokens)


def test_tenants_never_see_each_other(replicas: Any) -> None:
    kind, a, b, plain = replicas
    messages = [{"role": "system", "content": SYSTEMS[1] + " tenants"}, {"role": "user", "content": USERS[3]}]
    served(a, messages, key="tenant-a")
    other = chat(b, messages, key="tenant-b")
    assert cached(other) == 0
    assert cached(chat(b, messages, key="tenant-a")) >= other.usage.prompt_tokens - 1


@pytest.fixture(scope="module")
def fragile(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A redis-server of its own, to kill and fill, with two replicas and the plain reference."""
    path = tiny_model("llama")
    with run_redis(tmp_path_factory.mktemp("fragile")) as server:
        args = shared_args(path, server.url, "fragile")
        with run_server(args) as a, run_server(args) as b, run_server(model_args(path, flash_attn="false"), plain=True) as plain:
            yield server, a, b, plain


def available(*servers: Server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(s.metric("shared_available") == 1 for s in servers):
        assert time.monotonic() < deadline, "a replica did not reconnect"
        time.sleep(0.05)


def conversation(name: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"{name}: " + SYSTEMS[0]}, {"role": "user", "content": USERS[0]}]


def answered(server: Server, plain: Server, messages: list[dict[str, str]], within: float = 10.0) -> Any:
    """The answer of ``server``, which must equal a fresh context's and come within ``within`` seconds."""
    started = time.monotonic()
    response = chat(server, messages)
    assert time.monotonic() - started < within
    assert content(response) == content(chat(plain, messages))
    return response


def test_a_killed_restarted_hung_full_or_lying_server_never_costs_an_answer(fragile: Any) -> None:
    server, a, b, plain = fragile
    # killed: the next turn, on the replica that never saw the conversation, is evaluated in full
    messages = conversation("killed")
    served(a, messages)
    server.kill()
    assert cached(answered(b, plain, messages + [{"role": "user", "content": USERS[1]}])) == 0
    assert b.metric("shared_available") == 0 and b.metric("shared_errors_total") >= 1
    # restarted (empty): both replicas reconnect by themselves and share again
    server.start()
    available(a, b)
    messages = conversation("restarted")
    served(a, messages)
    assert cached(answered(b, plain, messages)) > 50
    # serving garbage: every blob overwritten; the answer is still right, the values are dropped
    messages = conversation("garbage")
    served(a, messages)
    client = server.client()
    for key in server.keys("fragile:*:b:*"):
        client.set(key, b"not a state")
    hits = b.metric("shared_hits_total")
    assert cached(answered(b, plain, messages)) < 20  # the chat template's first tokens, from B's own memory
    assert b.metric("shared_corrupt_total") >= 1 and b.metric("shared_hits_total") == hits
    # hung (SIGSTOP): one read times out, then the replica leaves the server alone until it answers again
    messages = conversation("hung")
    served(a, messages)
    server.pause()
    try:
        for _ in range(2):
            answered(b, plain, messages, within=5.0)
    finally:
        server.resume()
    available(a, b)
    # full (maxmemory, noeviction): writes are refused, answers stay right
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", max(1, int(client.info("memory")["used_memory"]) - 1))
    errors = a.metric("shared_write_errors_total")
    messages = conversation("full")
    chat(a, messages)
    deadline = time.monotonic() + 10
    while a.metric("shared_write_errors_total") <= errors:
        assert time.monotonic() < deadline, "the refused write was not counted"
        time.sleep(0.05)
    answered(b, plain, messages)
    # full with LRU eviction (the recommended setting): entries come and go, answers stay right
    client.config_set("maxmemory-policy", "allkeys-lru")
    client.config_set("maxmemory", "2mb")
    for name in ("lru-1", "lru-2", "lru-3"):
        messages = conversation(name)
        chat(a, messages)
        answered(b, plain, messages)
    assert a.metric("shared_available") == b.metric("shared_available") == 1


def test_the_draft_models_state_travels_with_the_conversation(tiny_model: Any, redis_server: RedisServer) -> None:
    path = tiny_model("gemma3")
    args = shared_args(path, redis_server.url, "draft", "--checkpoint-draft-model", str(path),
                       "--checkpoint-admin", "true", "--checkpoint-admin-key", "operator")
    with run_server(args) as a, run_server(args) as b, run_server(model_args(path, flash_attn="false"), plain=True) as plain:
        a.metrics_key = b.metrics_key = "operator"
        messages = conversation("draft")
        first = served(a, messages)
        messages += [{"role": "assistant", "content": content(first)}, {"role": "user", "content": USERS[1]}]
        moved = chat(b, messages)
        assert content(moved) == content(chat(plain, messages))
        assert cached(moved) >= first.usage.prompt_tokens - 1
        stats = next(iter(httpx.get(f"{b.url}/checkpoints/stats", headers={"Authorization": "Bearer operator"},
                                    timeout=30).json()["models"].values()))
        assert stats["draft_dropped"] == 0 and stats["shared"]["hits"] == 1
    # every record of the stored entries names its draft state
    client = redis_server.client()
    for key in redis_server.keys("draft:*:e3:*"):
        entry = decode_entry(client.get(key), blob_refs=True)
        assert all(record.draft is not None for record in (entry.state, *entry.checkpoints))
