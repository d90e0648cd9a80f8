"""A far shared tier: a real redis-server behind a link of 20 ms round trips and 50 MB/s
(ckpt_plugin/testing/delay_proxy.py), replicas whose simulated model takes 1 ms per token to evaluate. The planner
evaluates a short suffix or a short shared prefix here rather than even ask the tier, and still fetches a long prefix;
asserted on counters (tokens evaluated, lookups, fetches), never on time."""

from __future__ import annotations

import itertools
import time
from typing import Any, Iterator

import numpy as np
import pytest

from ckpt_plugin.engine.manager import CheckpointManager
from ckpt_plugin.services.publishing import publish
from ckpt_plugin.tiers.shared.tier import SharedTier
from ckpt_plugin.testing import FAKE_KINDS, FakeBackend, run_prompt
from ckpt_plugin.testing.delay_proxy import DelayProxy, delay_proxy

from support.redis_servers import RedisServer, run_redis

SECONDS_PER_TOKEN = 1e-3
BASE = list(range(10, 1510))
ASK = BASE + [3, 4, 5, 6]
LOCAL = 1484
"""What the far replicas of the first test served themselves: all but 16 tokens of BASE."""


class TimedBackend(FakeBackend):
    """A simulated context whose evaluation takes time, as a model's does (1 ms a token: a small model on a few CPU
    cores; Gemma-3-270M takes 1.7 ms here)."""

    def decode(self, tokens: np.ndarray) -> None:
        time.sleep(SECONDS_PER_TOKEN * len(tokens))
        super().decode(tokens)


@pytest.fixture(scope="module")
def far(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, DelayProxy]]:
    with run_redis(tmp_path_factory.mktemp("redis")) as server:
        with delay_proxy("127.0.0.1", server.port, one_way_delay=0.010, bandwidth=50e6) as proxy:
            yield server, proxy


def replica(url: str, kind: str, prefix: str, **settings: Any) -> CheckpointManager:
    """A manager over a timed simulated context with a shared tier of its own at ``url``."""
    tier = SharedTier(url, prefix=prefix, timeout=5.0, retry=0.2)
    settings.setdefault("load_entrypoints", False)
    return CheckpointManager(TimedBackend(FAKE_KINDS[kind]), shared=tier, checkpoint_min_step=64, **settings)


def serve_and_publish(url: str, kind: str, prefix: str, prompt: list[int]) -> None:
    """A nearby replica serves ``prompt`` and writes its state to the tier."""
    near = replica(url, kind, prefix)
    run_prompt(near, prompt, 2)
    assert publish(near) and near.store.shared is not None and near.store.shared.drain(10)


WARM_UPS = itertools.count(5000, 1000)


def measure_the_link(manager: CheckpointManager) -> None:
    """Serve three prompts of their own first (no other replica serves them: nothing to restore): the tier's round
    trip is measured by their lookups (three measurements before it replaces the default) and the evaluation rate by
    their decode calls."""
    for _ in range(3):
        start = next(WARM_UPS)
        run_prompt(manager, list(range(start, start + 100)), 2)


def rates(manager: CheckpointManager) -> dict[str, Any]:
    """What the engine measured (shown when a decision differs from what the test expects)."""
    view = manager.rules.costs.snapshot()
    return {key: view[key] for key in ("eval_seconds_per_token", "eval_observations", "transfers", "recent_plans")}


def hits(manager: CheckpointManager) -> int:
    assert manager.store.shared is not None
    return manager.store.shared.counters.hits


@pytest.mark.parametrize("kind", ["plain", "swa"])
def test_a_short_suffix_is_evaluated_here_rather_than_fetched(far: tuple[RedisServer, DelayProxy], kind: str) -> None:
    server, proxy = far
    prefix = f"suffix-{kind}"
    by_cost, by_tokens = (replica(proxy.url, kind, prefix, plan_by_cost=flag) for flag in (True, False))
    for far_replica in (by_cost, by_tokens):
        measure_the_link(far_replica)
        run_prompt(far_replica, BASE[:LOCAL], 2)  # each served the conversation up to here itself
    serve_and_publish(server.url, kind, prefix, BASE)  # another replica served it 16 tokens further
    # By cost: 20 tokens here are cheaper than the round trips to the far tier, which is not even asked.
    lookups = by_cost.store.shared.counters.lookups
    assert run_prompt(by_cost, ASK) == len(ASK) - LOCAL, rates(by_cost)
    assert hits(by_cost) == 0 and by_cost.store.shared.counters.lookups == lookups
    assert by_cost.rules.costs.lookups_skipped == 1
    assert by_cost.counters.forced_reprocess == 0 and not by_cost.primary.backend.corrupted
    assert by_cost.primary.backend.memory[: len(ASK)] == ASK
    # By tokens (what the planner did before it knew costs): the fetch, to evaluate 4 tokens instead of 20.
    assert run_prompt(by_tokens, ASK) == len(ASK) - len(BASE)
    assert hits(by_tokens) == 1 and by_tokens.primary.backend.memory[: len(ASK)] == ASK


def test_a_long_prefix_is_still_fetched_and_a_short_one_is_not(far: tuple[RedisServer, DelayProxy]) -> None:
    server, proxy = far
    prefix = "long"
    serve_and_publish(server.url, "plain", prefix, BASE)
    fresh = replica(proxy.url, "plain", prefix)
    measure_the_link(fresh)
    costs = fresh.rules.costs.snapshot()
    assert costs["eval_observations"]["32"] > 0 and costs["transfers"]["shared"]["latency_observations"] >= 3
    # 1,500 tokens to evaluate (1.5 s here) against three round trips and a few kB: fetched.
    assert run_prompt(fresh, ASK) == len(ASK) - len(BASE)
    assert hits(fresh) == 1 and fresh.primary.backend.memory[: len(ASK)] == ASK
    # The tier's fixed cost was measured through the link: never less than its round trip.
    assert fresh.rules.costs.snapshot()["transfers"]["shared"]["latency_seconds"] >= 0.020
    # A prompt sharing only 32 tokens with the stored conversation: evaluated here, not fetched.
    other = replica(proxy.url, "plain", prefix)
    measure_the_link(other)
    short = BASE[:32] + [3, 4, 5, 6]
    assert run_prompt(other, short) == len(short), rates(other)
    assert hits(other) == 0 and other.rules.costs.lookups_skipped == 1
    assert other.primary.backend.memory[: len(short)] == short and not other.primary.backend.corrupted
