"""The shared tier on a real redis-server, with simulated model contexts: two managers with tiers of their own stand
for two replicas. What a replica never saw, it restores from the other's entries; tenants and models stay apart;
a failing server (killed, restarted, paused, full, serving garbage) is a miss, never an error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckpt_plugin.engine.manager import CheckpointManager
from ckpt_plugin.services.publishing import publish
from ckpt_plugin.tiers.shared.tier import SharedTier
from ckpt_plugin.testing import fake_manager, run_prompt
from ckpt_plugin.testing.waiting import wait_until

from support.redis_servers import RedisServer, run_redis

PROMPT = list(range(10, 210))


def replica(url: str, kind: str = "swa", prefix: str = "t", **settings: Any) -> CheckpointManager:
    """A manager with a shared tier of its own (its own connections, digests and write-behind thread)."""
    tier = SharedTier(url, prefix=prefix, timeout=0.3, retry=0.2)
    return fake_manager(kind, shared=tier, checkpoint_min_step=64, **settings)


def published(manager: CheckpointManager) -> None:
    assert publish(manager)
    assert manager.store.shared is not None and manager.store.shared.drain(10)


def continue_on(manager: CheckpointManager, prompt: list[int]) -> int:
    """Serve ``prompt`` (as a host would) and return the tokens kept without evaluation."""
    evaluated = run_prompt(manager, prompt, 2)
    return len(prompt) + 2 - evaluated


@pytest.mark.parametrize("kind", ["plain", "swa", "recurrent", "hybrid"])
def test_a_replica_continues_and_branches_what_another_replica_served(redis_server: RedisServer, kind: str) -> None:
    prefix = f"kind-{kind}"
    a, b = replica(redis_server.url, kind, prefix), replica(redis_server.url, kind, prefix)
    run_prompt(a, PROMPT, 2)
    published(a)
    follow_up = PROMPT + [7] + list(range(400, 420))
    kept = continue_on(b, follow_up)
    assert kept >= len(PROMPT) - 1, kept
    assert b.store.shared.counters.hits == 1 and b.counters.disk_hits == 0
    assert not b.primary.backend.corrupted and b.primary.backend.memory[: len(follow_up)] == follow_up
    # a third replica branches off inside the first prompt: a checkpoint (or a truncation) of A's entry serves it
    c = replica(redis_server.url, kind, prefix)
    branch = PROMPT[:150] + list(range(500, 520))
    kept = continue_on(c, branch)
    assert kept >= (1 if kind in ("plain",) else 64), kept
    assert not c.primary.backend.corrupted and c.primary.backend.memory[: len(branch)] == branch
    # only the blobs the plan restores were read: the full state and one checkpoint
    stats = c.store.shared.stats()
    assert stats["hits"] == 1 and stats["round_trips"] == 3, stats


def test_tenants_and_models_never_see_each_other(redis_server: RedisServer) -> None:
    a = replica(redis_server.url, namespace="key:tenant-a", prefix="tenants")
    run_prompt(a, PROMPT, 2)
    published(a)
    other_tenant = replica(redis_server.url, namespace="key:tenant-b", prefix="tenants")
    assert continue_on(other_tenant, PROMPT + [7, 8]) == 0
    other_model = replica(redis_server.url, namespace="key:tenant-a", prefix="tenants")
    other_model.captures.fingerprint = "another-model"  # states it captures and looks up are another model's
    assert continue_on(other_model, PROMPT + [7, 8]) == 0
    same = replica(redis_server.url, namespace="key:tenant-a", prefix="tenants")
    assert continue_on(same, PROMPT + [7, 8]) > 150
    keys = redis_server.keys("tenants:*")
    assert len({k.split(b":")[2] for k in keys}) == 1  # one namespace digest in every key


def test_shared_checkpoints_are_stored_once(redis_server: RedisServer) -> None:
    a = replica(redis_server.url, prefix="dedup")
    run_prompt(a, PROMPT, 2)
    published(a)
    run_prompt(a, PROMPT + [7] + list(range(600, 700)), 2)
    published(a)
    blobs = redis_server.keys("dedup:*:b:*")
    # two full states, plus each checkpoint once although both entries hold the early ones
    n_checkpoints = len(a.primary.slot.checkpoints)
    assert len(blobs) == 2 + n_checkpoints, (len(blobs), n_checkpoints)
    assert len(redis_server.keys("dedup:*:e3:*")) == 2


def test_corrupted_values_are_misses_and_are_dropped(redis_server: RedisServer) -> None:
    a = replica(redis_server.url, prefix="corrupt")
    run_prompt(a, PROMPT, 2)
    published(a)
    client = redis_server.client()
    for key in redis_server.keys("corrupt:*:b:*"):
        client.set(key, b"garbage")
    b = replica(redis_server.url, prefix="corrupt")
    assert continue_on(b, PROMPT + [7, 8]) == 0
    assert b.store.shared.counters.corrupt >= 1 and not b.primary.backend.corrupted
    b.store.shared.drain(5)
    for key in redis_server.keys("corrupt:*:e3:*"):
        client.set(key, b"CKPTSLOT" + b"\0" * 300)
    c = replica(redis_server.url, prefix="corrupt")
    assert continue_on(c, PROMPT + [7, 8]) == 0
    assert c.store.shared.counters.corrupt == 1 and c.store.shared.available
    for key in redis_server.keys("corrupt:*:i3:*"):
        client.set(key, b"../not-an-id")
    d = replica(redis_server.url, prefix="corrupt")
    assert continue_on(d, PROMPT + [7, 8]) == 0 and d.store.shared.counters.misses == 1


def test_a_dead_or_hung_server_is_a_miss_and_is_found_again(tmp_path: Path) -> None:
    with run_redis(tmp_path) as own:
        a, b = replica(own.url), replica(own.url)
        run_prompt(a, PROMPT, 2)
        published(a)
        own.kill()
        assert continue_on(b, PROMPT + [7, 8]) == 0
        # one lookup, failed at once (refused), then the server is left alone: the request never waits on it
        assert b.store.shared.counters.lookups == b.store.shared.counters.errors == 1
        assert not b.store.shared.available
        # while it is down, requests do not touch it, and writes are dropped
        assert b.store.shared.lookup("default", b.fingerprint, np.asarray(PROMPT), b.kind, 199) == []
        assert not publish(a) or a.store.shared.drain(5)
        own.start()
        wait_until(lambda: a.store.shared.available and b.store.shared.available, timeout=60,
                   message="the replicas did not find the restarted server")
        run_prompt(a, PROMPT + list(range(800, 840)), 2)
        published(a)
        c = replica(own.url)
        assert continue_on(c, PROMPT + list(range(800, 840)) + [7, 8]) > 200
        # a hung server (SIGSTOP): the read times out once, then it is left alone until it answers again
        own.pause()
        try:
            d = replica(own.url)
            for _ in range(3):
                continue_on(d, PROMPT + list(range(800, 840)) + [7, 9])
            # one read timed out (at most one lookup sent), the other requests never asked
            assert d.store.shared.counters.errors == 1 and d.store.shared.counters.lookups <= 1
            assert not d.store.shared.available
        finally:
            own.resume()
        wait_until(lambda: d.store.shared.available, timeout=60, message="the resumed server was not found again")


def test_a_full_server_refuses_writes_without_failing_requests(tmp_path: Path) -> None:
    with run_redis(tmp_path, maxmemory="1mb", maxmemory_policy="noeviction") as full:
        client = full.client()
        a = replica(full.url)
        # fill the server first: every later write is refused with an OOM error
        for i in range(64):
            try:
                client.set(f"filler:{i}", b"x" * 65536)
            except Exception:
                break
        run_prompt(a, PROMPT, 2)
        published(a)
        stats = a.store.shared.stats()
        assert stats["write_errors"] >= 1 and stats["writes"] == 0 and stats["available"] == 1
        b = replica(full.url)
        assert continue_on(b, PROMPT + [7, 8]) == 0 and not b.primary.backend.corrupted


def test_a_full_queue_drops_and_counts(redis_server: RedisServer) -> None:
    tier = SharedTier(redis_server.url, prefix="no-queue", timeout=0.2, retry=60, queue=0)
    a = fake_manager("swa", shared=tier)
    run_prompt(a, PROMPT, 2)
    assert not publish(a)
    assert tier.stats()["write_drops"] >= 1
    assert tier.lookup("default", a.fingerprint, np.asarray(PROMPT), a.kind, 199) == []


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379", "redis://:secret@127.0.0.1:notaport/0",
                                 "redis://:secret@127.0.0.1:6379/db", "redis://", "unix://"])
def test_a_bad_url_exits_2_with_a_message_that_keeps_the_password(url: str, capsys: Any) -> None:
    from ckpt_plugin_integrations.llama_cpp_server.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["--model", "x.gguf", "--checkpoint-redis-url", url])
    message = capsys.readouterr().err
    assert exited.value.code == 2 and "redis_url" in message and "secret" not in message, message
    from ckpt_plugin.core.config import CheckpointSettings

    with pytest.raises(ValueError) as refused:  # from the library too
        CheckpointSettings(redis_url=url)
    assert "secret" not in str(refused.value)


def test_the_url_comes_from_flags_the_file_or_the_environment(tmp_path: Path, monkeypatch: Any) -> None:
    from ckpt_plugin_integrations.llama_cpp_server.cli import load_settings

    url = "rediss://user:secret@cache.internal:6380/2"
    flags = load_settings(["--model", "x.gguf", "--checkpoint-redis-url", url, "--checkpoint-redis-ttl", "600"])[2]
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"models": [{"model": "x.gguf"}],
                                  "checkpoints": {"redis_url": url, "redis_ttl": 600}}))
    from_file = load_settings(["--config_file", str(config)])[2]
    monkeypatch.setenv("CKPT_REDIS_URL", url)
    monkeypatch.setenv("CKPT_REDIS_TTL", "600")
    from_env = load_settings(["--model", "x.gguf"])[2]
    for settings in (flags, from_file, from_env):
        assert settings.redis_url.get_secret_value() == url and settings.redis_ttl == 600
        assert "secret" not in repr(settings)


def test_passwords_are_taken_as_redis_py_takes_them(tmp_path: Path) -> None:
    with run_redis(tmp_path, requirepass="s3cret") as locked:
        url = f"redis://:s3cret@127.0.0.1:{locked.port}/0"
        a, b = replica(url, prefix="auth"), replica(url, prefix="auth")
        run_prompt(a, PROMPT, 2)
        published(a)
        assert continue_on(b, PROMPT + [7, 8]) > 150
        wrong = replica(f"redis://:wrong@127.0.0.1:{locked.port}/0", prefix="auth")
        assert continue_on(wrong, PROMPT + [7, 8]) == 0
        assert not wrong.store.shared.available and "wrong" not in wrong.store.shared.url


def test_lookup_and_fetch_latencies_are_prometheus_histograms(redis_server: RedisServer) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from ckpt_plugin.http.metrics import SharedTierCollector

    a = replica(redis_server.url, prefix="latency")
    run_prompt(a, PROMPT, 2)
    published(a)
    b = replica(redis_server.url, prefix="latency")
    continue_on(b, PROMPT + [7])
    buckets, total = b.store.shared.stats()["lookup_seconds"]
    assert buckets[-1][0] == "+Inf" and buckets[-1][1] >= 1 and total > 0
    registry = CollectorRegistry()
    registry.register(SharedTierCollector(lambda: {"b": b}))
    text = generate_latest(registry).decode()
    assert 'ckpt_shared_lookup_seconds_bucket{le="+Inf",server=' in text
    assert "ckpt_shared_fetch_seconds_count" in text
