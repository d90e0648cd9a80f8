"""The shared tier stores pages by id, on a real redis-server with real contexts: a turn writes only the pages it
adds, a conversation on a shared prompt writes only its own pages, a replica reads only the pages it lacks, and a
corrupt or missing page is a miss (the request answered from scratch, the same tokens)."""

from __future__ import annotations

import random
from typing import Any

import pytest

import ckpt_plugin
from ckpt_plugin.services.publishing import publish

from support.live_pages import drop_states
from support.redis_servers import RedisServer

SYSTEM = [1, *random.Random("shared-pages").choices(range(3, 250), k=159)]  # pages no other test's states hold


def replica(make_llama: Any, url: str, prefix: str, kind: str = "gemma3", **settings: Any) -> Any:
    llama = make_llama(kind)
    ckpt_plugin.attach(llama, redis_url=url, redis_prefix=prefix, checkpoint_min_step=16, load_entrypoints=False,
                       **settings)
    return llama


def answer(llama: Any, prompt: list[int]) -> str:
    return llama.create_completion(prompt, max_tokens=4, temperature=0)["choices"][0]["text"]


def forget(llama: Any) -> None:
    """Detach ``llama`` and drop every state it held: none of its pages stays live in this process."""
    assert drop_states(llama)


def published(llama: Any) -> dict[str, Any]:
    """Write the slot's state to the shared tier and wait for it; return the tier's stats."""
    manager = ckpt_plugin.manager_of(llama)
    assert publish(manager)
    assert manager.store.shared.drain(10)
    return manager.store.shared.stats()


@pytest.mark.parametrize("kind", ["gemma3", "llama"])
def test_a_turn_writes_only_the_pages_it_adds(make_llama: Any, redis_server: RedisServer, kind: str) -> None:
    # 8-position pages: the tiny gemma3's window is 32 positions (Gemma-3-270M's 512 spans 16 pages of 32)
    a = replica(make_llama, redis_server.url, f"turns-{kind}", kind, page_positions=8)
    turn = SYSTEM + list(range(170, 180))
    answer(a, turn)
    first = published(a)
    n_first = len(a._input_ids)
    turn = list(a._input_ids) + list(range(200, 230))
    answer(a, turn)
    second = published(a)
    written = second["bytes_written"] - first["bytes_written"]
    manager = ckpt_plugin.manager_of(a)
    # what whole states write: the full state and each checkpoint the turn added
    whole = manager.primary.backend.state_size(False) + sum(
        c.nbytes for c in manager.primary.slot.checkpoints if c.n_tokens > n_first)
    assert 0 < written < whole / 2, (written, whole)
    assert second["pages_present"] > first["pages_present"]


def test_conversations_on_one_prompt_share_its_pages_and_a_replica_reads_only_what_it_lacks(
        make_llama: Any, redis_server: RedisServer) -> None:
    a = replica(make_llama, redis_server.url, "shared-prompt")
    answer(a, SYSTEM + list(range(170, 180)))
    first = published(a)
    answer(a, SYSTEM + list(range(180, 190)))  # another user, the same system prompt
    second = published(a)
    assert second["bytes_written"] - first["bytes_written"] < first["bytes_written"] / 3

    forget(a)  # B is as a replica in another process

    b = replica(make_llama, redis_server.url, "shared-prompt")
    fresh = make_llama("gemma3")
    prompt = SYSTEM + list(range(180, 190)) + [7, 8, 9]
    assert answer(b, prompt) == answer(fresh, prompt)
    stats = ckpt_plugin.manager_of(b).store.shared.stats()
    assert stats["hits"] == 1 and stats["pages_read"] > 0 and stats["pages_held"] == 0
    assert ckpt_plugin.manager_of(b).counters.tokens_reused_from_shared > len(SYSTEM) - 32
    # the other conversation: the system prompt's pages this replica holds live (the first conversation went into
    # its RAM cache when the slot moved on) are not read again
    answer(b, [1, *range(300, 340)])
    fresh.reset()
    prompt = SYSTEM + list(range(170, 180)) + [7, 8, 9]
    assert answer(b, prompt) == answer(fresh, prompt)
    stats = ckpt_plugin.manager_of(b).store.shared.stats()
    assert stats["hits"] == 2 and stats["pages_held"] > 0


def test_a_corrupt_or_missing_page_is_a_miss(make_llama: Any, redis_server: RedisServer) -> None:
    a = replica(make_llama, redis_server.url, "bad-pages")
    answer(a, SYSTEM + list(range(170, 180)))
    published(a)
    client = redis_server.client()
    pages = [key for key in redis_server.keys("bad-pages:*:b:*") if not client.get(key).startswith(b"CKPTPGM")]
    assert pages
    forget(a)  # no live page of A's to take instead of reading
    for key in pages[::2]:
        client.set(key, b"garbage" + client.get(key)[7:])
    b = replica(make_llama, redis_server.url, "bad-pages")
    fresh = make_llama("gemma3")
    prompt = SYSTEM + list(range(170, 180)) + [5]
    assert answer(b, prompt) == answer(fresh, prompt)
    stats = ckpt_plugin.manager_of(b).store.shared.stats()
    assert stats["corrupt"] >= 1 and stats["hits"] == 0
    for key in pages[1::2]:
        client.delete(key)
    c = replica(make_llama, redis_server.url, "bad-pages")
    fresh.reset()
    assert answer(c, prompt) == answer(fresh, prompt)
    assert ckpt_plugin.manager_of(c).store.shared.stats()["hits"] == 0


def test_tenants_share_no_page(make_llama: Any, redis_server: RedisServer) -> None:
    a = replica(make_llama, redis_server.url, "page-tenants", namespace="alice")
    answer(a, SYSTEM + list(range(170, 180)))
    published(a)
    alice = set(redis_server.keys("page-tenants:*:b:*"))
    b = replica(make_llama, redis_server.url, "page-tenants", namespace="bob")
    answer(b, SYSTEM + list(range(170, 180)))
    assert ckpt_plugin.manager_of(b).store.shared.stats()["hits"] == 0
    published(b)
    bob = set(redis_server.keys("page-tenants:*:b:*")) - alice
    assert bob and not {key.rsplit(b":", 1)[1] for key in bob} & {key.rsplit(b":", 1)[1] for key in alice}
