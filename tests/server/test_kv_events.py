"""KV events of real ckpt-serve processes (``--kv-events-config``, vLLM's JSON) read by real consumers: a ZeroMQ SUB
socket and replay requests decoding with vLLM's event definitions (tests/support/kv_events.py), and vllm-router's
kv_aware policy, which indexes them and credits the prefixes a replica announced.

Every whole page a replica holds is announced once per medium with its tokens and parent, its going is announced,
``DELETE /checkpoints`` and a start say ``AllBlocksCleared``, the ids are the pages' own (the shared tier stores the
pages under them), and the replay socket gives back what a subscriber missed.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from ckpt_plugin.testing.ports import free_port

from support.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, Consumer
from support.redis_servers import RedisServer
from ckpt_plugin.testing.servers import http_ready, serving

from support.servers import Server, model_args, run_server
from support.shared_chat import written

SYSTEM = "the cat and the dog went to the house and then the bird sang a song "
USERS = ["hello", "and then what", "tell me more", "one more time"]
VLLM_ROUTER = Path(sys.executable).parent / "vllm-router"


class Replica:
    """A ckpt-serve publishing KV events, and a consumer of them."""

    def __init__(self, server: Server, pub: int, replay: int, topic: str) -> None:
        self.server = server
        self.pub = pub
        self.replay = replay
        self.consumer = Consumer(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", topic=topic.encode())

    def chat(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        response = self.server.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4,
                                                                  "temperature": 0})
        assert response.status_code == 200, response.text
        return response.json()

    def prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt's token ids as the server builds it (vLLM's render route)."""
        response = self.server.post("/v1/chat/completions/render", json={"messages": messages})
        assert response.status_code == 200, response.text
        return response.json()["token_ids"]

    def converse(self, names: list[str], turns: int) -> list[list[int]]:
        """``turns`` turns of one conversation per name, taking turns on the one slot (each turn parks the other
        conversation's state: a capture, so pages); the prompts' token ids."""
        conversations = [[{"role": "system", "content": f"{name}: " + SYSTEM * 6}] for name in names]
        prompts = []
        for turn in range(turns):
            for messages in conversations:
                messages.append({"role": "user", "content": USERS[turn % len(USERS)]})
                prompts.append(self.prompt(messages))
                messages.append(self.chat(messages)["choices"][0]["message"])
        return prompts


@contextlib.contextmanager
def replica(args: list[str], env: dict[str, str] | None = None, topic: str = "kv") -> Iterator[Replica]:
    pub, replay = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": topic}
    with run_server([*args, "--kv-events-config", json.dumps(config)], env=env) as server:
        running = Replica(server, pub, replay, topic)
        try:
            yield running
        finally:
            running.consumer.close()


@pytest.fixture(scope="module")
def ram(tiny_model: Any) -> Iterator[Replica]:
    """One replica whose state budget holds a few conversations: later ones evict earlier ones."""
    with replica(model_args(tiny_model("llama")) + ["--admin", "true", "--cache-max-bytes", "320KiB"]) as running:
        yield running


def covers(prefix: list[int], prompts: list[list[int]]) -> bool:
    """Whether ``prefix`` (a chain of announced blocks) starts one of ``prompts`` (a state also holds the tokens
    generated after its prompt, which the next prompt may tokenize otherwise)."""
    return any(len(prefix) >= 32 and prefix[:len(prompt)] == prompt[:len(prefix)] for prompt in prompts)


def test_every_whole_page_is_announced_once_with_its_tokens_and_parent(ram: Replica) -> None:
    prompts = ram.converse(["alpha", "beta"], turns=3)
    index, batches = ram.consumer.index(until=lambda index: len(index.stored) >= 10)
    assert batches[0].events == [AllBlocksCleared()]  # the start: nothing of an earlier process stands
    stored = [event for batch in batches for event in batch.events if isinstance(event, BlockStored)]
    assert {(e.medium, e.block_size, e.group_idx, e.lora_id, e.lora_name) for e in stored} == {("CPU", 32, 0, None,
                                                                                                  None)}
    assert all(isinstance(digest, int) and 0 <= digest < 1 << 64 for e in stored for digest in e.block_hashes)
    # each block's chain of parents gives the tokens from position 0, and they are a prompt's
    chains = [index.prefixes[digest] for e in stored for digest in e.block_hashes if digest in index.prefixes]
    assert chains and all(covers(chain, prompts) for chain in chains)
    assert max(len(chain) for chain in chains) >= 96
    # one event per run of consecutive blocks of one capture, as vLLM sends a request's blocks
    assert any(len(e.block_hashes) > 1 for e in stored)


def test_evictions_are_announced_once_for_pages_announced(ram: Replica) -> None:
    ram.converse(["gamma", "delta", "epsilon"], turns=2)
    # Index.apply refuses a removal of a page never announced, or announced and removed already
    index, batches = ram.consumer.index(until=lambda index: index.removed > 0)
    removed = [e for batch in batches for e in batch.events if isinstance(e, BlockRemoved)]
    assert all(e.medium == "CPU" and e.group_idx == 0 for e in removed)
    assert index.live, "the conversations still held have their pages"


def test_delete_checkpoints_clears_and_later_pages_are_announced_again(ram: Replica) -> None:
    index, _ = ram.consumer.index()
    assert index.live
    clears = index.clears
    assert httpx.delete(f"{ram.server.url}/checkpoints", timeout=60).status_code == 200
    index, _ = ram.consumer.index(until=lambda index: index.clears == clears + 1)
    assert not index.live
    ram.converse(["zeta", "eta"], turns=2)
    index, _ = ram.consumer.index(until=lambda index: len(index.live) > 0)


def test_a_late_subscriber_gets_what_it_missed_from_the_replay_socket(ram: Replica) -> None:
    ram.consumer.index()
    late = Consumer(f"tcp://127.0.0.1:{ram.pub}", f"tcp://127.0.0.1:{ram.replay}", topic=b"kv")
    try:
        assert late.poll(0.3) == 0  # nothing new was published: the SUB socket missed everything before it
        replayed = late.replay(0)
        assert [seq for seq, _ in replayed] == list(range(len(replayed)))
        assert dict(replayed) == ram.consumer.received
        assert late.replay(len(replayed) - 1) == replayed[-1:]
    finally:
        late.close()


def test_kv_event_sources_answers_as_vllm(ram: Replica) -> None:
    sources = httpx.get(f"{ram.server.url}/kv_event_sources", timeout=10).json()
    assert sources == {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ram.pub}",
                             "replay_endpoint": f"tcp://*:{ram.replay}", "buffer_steps": 10000, "hwm": 100000,
                             "max_queue_size": 100000, "topic": "kv"}}


@pytest.fixture(scope="module")
def shared(tiny_model: Any, redis_server: RedisServer) -> Iterator[Replica]:
    """A replica writing its states to a real redis-server, its block hashes sent as bytes (vLLM's
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``): the whole 16-byte page ids."""
    args = model_args(tiny_model("llama")) + ["--redis-url", redis_server.url, "--redis-prefix", "kv-events"]
    with replica(args, env={"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}) as running:
        yield running


def whole_pages_in(redis_server: RedisServer) -> set[bytes]:
    """The ids of the whole pages the shared tier holds: its page keys (``<partition>b:<id>``) whose value is a
    page (its bytes, then their XXH3-128 digest) of the largest size, a whole page's."""
    import redis
    import xxhash

    client = redis.Redis.from_url(redis_server.url)
    pages = {}
    for key in client.scan_iter(match="kv-events:*b:*"):
        value = client.get(key)
        if value is not None and len(value) > 16 and xxhash.xxh3_128_digest(value[:-16]) == value[-16:]:
            pages[bytes.fromhex(key.decode().rsplit(":", 1)[1])] = len(value)
    largest = max(pages.values(), default=0)
    return {page_id for page_id, size in pages.items() if size == largest}


def test_pages_written_to_the_shared_tier_are_announced_under_their_ids(shared: Replica,
                                                                         redis_server: RedisServer) -> None:
    before = shared.server.metric("shared_writes_total")
    shared.converse(["theta"], turns=3)
    written(shared.server, before)
    expected = whole_pages_in(redis_server)
    assert len(expected) >= 6
    index, batches = shared.consumer.index(until=lambda index: index.hashes("STORAGE") == expected)
    remote = [e for batch in batches for e in batch.events if isinstance(e, BlockStored) and e.medium == "STORAGE"]
    assert all(e.locality == "REMOTE" and all(len(d) == 16 for d in e.block_hashes) for e in remote)
    assert expected <= {digest for medium, digest in index.stored if medium == "CPU"}


@pytest.mark.skipif(not VLLM_ROUTER.exists(), reason="vllm-router is not installed (pip install vllm-router==0.1.17)")
def test_vllm_router_kv_aware_credits_the_prefixes_a_replica_announced(tiny_model: Any) -> None:
    args = model_args(tiny_model("llama"))
    # vllm-router's static sources take the topic "", vLLM's default
    with replica(args, topic="") as a, replica(args, topic="") as b:
        port = free_port()
        command = [str(VLLM_ROUTER), "--worker-urls", a.server.url, b.server.url, "--policy", "kv_aware",
                   "--host", "127.0.0.1", "--port", str(port), "--log-level", "debug", "--kv-event-model", "m",
                   "--kv-event-block-size", "32"]
        for r in (a, b):
            command += ["--kv-event-source", f"{r.server.url}=tcp://127.0.0.1:{r.pub}",
                        "--kv-event-replay-source", f"{r.server.url}=tcp://127.0.0.1:{r.replay}"]
        with serving(command, http_ready(f"http://127.0.0.1:{port}/health"), name="vllm-router",
                     timeout=60) as (_, log):
            conversations = [[{"role": "system", "content": f"{name}: " + SYSTEM * 6}] for name in ("one", "two")]
            for turn in range(3):
                for messages in conversations:
                    messages.append({"role": "user", "content": USERS[turn]})
                    response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                                          json={"model": "m", "messages": messages, "max_tokens": 4,
                                                "temperature": 0})
                    assert response.status_code == 200, response.text
                    messages.append(response.json()["choices"][0]["message"])
            text = re.sub(r"\x1b\[[0-9;]*m", "", "".join(log))
    # the router subscribed to both replicas and read their batches
    assert "kv_index live sequence advanced" in text or "kv_index replay sequence advanced" in text
    credited = [int(n) for n in re.findall(r"KV prefix decision .*?credited_prefix_tokens=(\d+)", text)]
    assert len(credited) == 6 and max(credited) >= 32 * 4, credited
