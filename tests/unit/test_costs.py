"""Plans and captures by cost: the rates (ckpt_plugin/costs.py), the planner and the schedule weighing them, and
where they show (stats, /metrics). Pure properties first, then engines over simulated contexts; the HTTP views are
tests/server/test_cost_views.py's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckpt_plugin.core.checkpoint import Checkpoint
from ckpt_plugin.tiers.cost_probes import CostProbe
from ckpt_plugin.policy.costs import (
    DEFAULT_RATES,
    EVAL_BUCKETS,
    MIN_RATE_BYTES,
    CostModel,
    Rates,
    TransferRate,
    clearly_cheaper,
    with_transfer,
)
from ckpt_plugin.http.metrics import Metrics
from ckpt_plugin.policy.plan_record import PlanClock
from ckpt_plugin.core.memory import MemoryKind
from ckpt_plugin.policy.plan import Hit, LiveMemory, Plan, best_reuse, can_truncate, plan_prompt
from ckpt_plugin.policy.schedule import CheckpointRules, pause_points, want_checkpoint
from ckpt_plugin.testing import fake_manager, run_prompt
from ckpt_plugin.tiers.protocol import Query

from support.factories import Stored, window_checkpoint
from support.strategies import KINDS, stored, tokens

CPU_LIKE = Rates.flat(1e-3, latency=1e-6, bandwidth=1e12, full_bytes_per_token=4)
"""Evaluating a token costs a millisecond, copying any state here a microsecond."""
RECOMPUTE_CHEAP = Rates.flat(1e-6, latency=0.05, bandwidth=1e6, full_bytes_per_token=4)
"""Evaluating a token costs a microsecond, every restore or fetch at least 50 ms."""


def partial(kind: MemoryKind, n_tokens: int, n_bytes: int = 8) -> Checkpoint:
    return window_checkpoint(kind, n_tokens, n_bytes=max(n_bytes, 1))


@dataclass
class Case:
    kind: MemoryKind
    prompt: np.ndarray
    live: LiveMemory
    candidates: list[Stored]
    tiers: list[str]

    def plan(self, rates: Rates | None) -> tuple[Plan[Stored], list[int]]:
        fetched: list[int] = []

        def fetcher(i: int) -> Any:
            def fetch() -> Stored:
                fetched.append(i)
                return self.candidates[i]
            return fetch

        bounds = [int(np.argmin(np.append(c.tokens[: len(self.prompt)] == self.prompt[: len(c.tokens)], False)))
                  for c in self.candidates]
        hits = [Hit(self.tiers[i], bounds[i], fetcher(i)) for i in range(len(self.candidates))]
        return plan_prompt(self.kind, self.prompt, self.live, hits, min_discard=3, min_tokens=2, rates=rates), fetched


@st.composite
def cases(draw: st.DrawFn) -> Case:
    kind = draw(st.sampled_from(KINDS))
    prompt = np.asarray(draw(tokens), dtype=np.int32)
    base = draw(stored(kind))
    live = LiveMemory(base.tokens, draw(st.integers(0, base.n_tokens)), base.pos_min, base.checkpoints)
    candidates = draw(st.lists(stored(kind), max_size=5))
    tiers = draw(st.lists(st.sampled_from(["ram", "disk", "shared"]), min_size=len(candidates),
                          max_size=len(candidates)))
    return Case(kind, prompt, live, candidates, tiers)


def same_plan(a: Plan[Stored], b: Plan[Stored]) -> bool:
    return (a.n_keep, a.tier, a.restore_state, a.park_live, a.live, a.n_shared) == (
        b.n_keep, b.tier, b.restore_state, b.park_live, b.live, b.n_shared) and a.entry is b.entry and (
        a.checkpoint is b.checkpoint)


# --- pure: the rates ---------------------------------------------------------------------------------------------


@given(st.lists(st.tuples(st.integers(1, 2000), st.floats(1e-7, 1e-1)), min_size=1, max_size=len(EVAL_BUCKETS),
                unique_by=lambda point: point[0]),
       st.integers(0, 5000), st.integers(0, 5000))
def test_more_tokens_never_cost_less_to_evaluate(points: list[tuple[int, float]], n: int, m: int) -> None:
    rates = Rates(tuple((float(size), rate) for size, rate in sorted(points)))
    low, high = sorted((n, m))
    assert rates.eval_seconds(low) <= rates.eval_seconds(high)
    assert rates.eval_seconds(0) == 0.0


def test_the_first_observation_replaces_the_default_and_later_ones_are_averaged() -> None:
    costs = CostModel()
    assert costs.rates() == DEFAULT_RATES and not costs.calibrated
    costs.observe_eval(64, 64 * 2e-5)
    assert costs.calibrated and costs.rates().eval_seconds(64) == pytest.approx(64 * 2e-5)
    # buckets never measured take the nearest measured one, not the CPU-like default
    assert costs.rates().eval_seconds(1000) == pytest.approx(1000 * 2e-5)
    costs.observe_eval(64, 64 * 4e-5)
    assert 2e-5 < costs.snapshot()["eval_seconds_per_token"]["32"] < 4e-5
    costs.observe_eval(1, 1e-3)
    assert costs.rates().eval_seconds(1) == pytest.approx(1e-3)
    # A lone token's overhead is not multiplied out: 16 tokens cost between one token and 64 tokens, interpolated.
    assert 1e-3 <= costs.rates().eval_seconds(16) <= costs.rates().eval_seconds(64) < 16e-3


def test_fixed_costs_are_the_smallest_recent_and_stalls_do_not_move_them() -> None:
    costs = CostModel()
    costs.observe_transfer("shared", 0, 0.060)  # a new connection's first lookup: its handshake too
    assert costs.rates().transfers["shared"].latency == DEFAULT_RATES.transfers["shared"].latency
    for seconds in (0.021, 0.020, 0.5, 0.022):  # one stall of half a second
        costs.observe_transfer("shared", 0, seconds)
    assert costs.rates().transfers["shared"].latency == pytest.approx(0.020)
    # small transfers say nothing about bandwidth; large ones do, net of the fixed cost
    costs.observe_transfer("shared", 1000, 0.020)
    assert costs.rates().transfers["shared"].bandwidth == DEFAULT_RATES.transfers["shared"].bandwidth
    costs.observe_transfer("shared", 50 * MIN_RATE_BYTES, 0.020 + 50 * MIN_RATE_BYTES / 50e6)
    assert costs.rates().transfers["shared"].bandwidth == pytest.approx(50e6)
    costs.observe_capture(8 << 20, 0.002, partial=True, n_tokens=1000)
    costs.observe_capture(12 << 20, 0.003, partial=False, n_tokens=1000)
    assert costs.rates().partial_bytes == 8 << 20 and costs.rates().state_bytes(1000) == 12 << 20


def test_a_fixed_model_learns_nothing() -> None:
    costs = CostModel()
    costs.fix(CPU_LIKE)
    costs.observe_eval(10, 1.0)
    assert costs.rates() is CPU_LIKE and costs.calibrated


# --- pure: plans -------------------------------------------------------------------------------------------------


@given(cases())
def test_with_cpu_like_rates_plans_are_exactly_the_most_tokens_plans(case: Case) -> None:
    by_tokens, fetched_by_tokens = case.plan(None)
    by_cost, fetched_by_cost = case.plan(CPU_LIKE)
    assert same_plan(by_cost, by_tokens) and fetched_by_cost == fetched_by_tokens
    assert not by_cost.by_cost and by_cost.most_tokens == by_tokens.n_keep and by_cost.fetches_skipped == 0
    assert by_cost.estimated_seconds >= CPU_LIKE.eval_seconds(len(case.prompt) - by_cost.n_keep)


@given(cases())
def test_where_recomputing_is_cheaper_the_plan_recomputes(case: Case) -> None:
    by_tokens, _ = case.plan(None)
    plan, fetched = case.plan(RECOMPUTE_CHEAP)
    # nothing is restored, nothing is read from a slower tier: only what the live memory keeps by truncation
    assert plan.entry is None and plan.checkpoint is None
    assert all(case.tiers[i] == "ram" for i in fetched)
    limit = max(len(case.prompt) - 1, 0)
    live = best_reuse(case.kind, case.live.lineage, case.live.n_tokens, case.live.pos_min, (), case.prompt, limit)
    assert plan.n_keep == live.n_keep
    assert can_truncate(case.kind, case.live.n_tokens, case.live.pos_min, plan.n_keep) or plan.n_keep == 0
    assert plan.most_tokens >= by_tokens.n_keep  # a candidate not fetched counts with what its index matched
    assert plan.by_cost == (plan.most_tokens > plan.n_keep)


def test_a_slow_tier_is_not_fetched_for_a_few_tokens_and_is_for_many() -> None:
    far = Rates.flat(1e-4, latency=1e-6, bandwidth=1e10)
    far = with_transfer(far, "shared", TransferRate(0.020, 50e6))
    kind = MemoryKind()
    prompt = np.arange(2000, dtype=np.int32)
    entry = Stored(prompt[:1900].copy(), 0)
    fetched: list[int] = []

    def hit() -> Hit[Stored]:
        return Hit("shared", 1900, lambda: fetched.append(1) or entry)  # type: ignore[func-returns-value]

    near = LiveMemory(prompt[:1880].copy(), 1880, 0, ())
    plan = plan_prompt(kind, prompt, near, [hit()], 16, 32, rates=far)
    assert plan.entry is None and plan.n_keep == 1880 and not fetched and plan.fetches_skipped == 1
    nothing = LiveMemory(np.zeros(0, dtype=np.int32), 0, 0, ())
    plan = plan_prompt(kind, prompt, nothing, [hit()], 16, 32, rates=far)
    assert plan.entry is entry and plan.n_keep == 1900 and fetched == [1] and not plan.by_cost


def test_the_far_tier_is_not_asked_when_even_its_best_answer_could_not_pay() -> None:
    far = with_transfer(Rates.flat(1e-4, latency=1e-6, bandwidth=1e10), "shared", TransferRate(0.020, 50e6))
    costs = CostModel()

    def query(n_prompt: int, floor: int = 0) -> Query:
        return Query("default", "fp", np.arange(n_prompt, dtype=np.int32), MemoryKind(), n_prompt - 1, floor=floor)

    # 40 tokens left to evaluate (4 ms) against the lookup's two round trips (40 ms): not asked
    assert not CostProbe(costs, far, 100, lambda: 60).lookup_pays(query(100))
    assert not CostProbe(costs, far, 100, lambda: 0).lookup_pays(query(100, floor=60))
    # 2,000 tokens (200 ms): a hit would pay, but a useless answer would cost 20% of the request: not asked
    assert not CostProbe(costs, far, 2000, lambda: 0).lookup_pays(query(2000))
    # 10,000 tokens (1 s): asked; without rates, always asked
    assert CostProbe(costs, far, 10_000, lambda: 0).lookup_pays(query(10_000))
    assert CostProbe(costs, None, 100, lambda: 99).lookup_pays(query(100))


def test_clearly_cheaper_needs_both_an_absolute_and_a_relative_saving() -> None:
    assert not clearly_cheaper(0.010, 0.0085)  # 1.5 ms: below the absolute floor
    assert not clearly_cheaper(1.0, 0.96)  # 40 ms, but 4%
    assert clearly_cheaper(0.030, 0.010)


# --- pure: captures ----------------------------------------------------------------------------------------------

SWA = MemoryKind(n_swa=4)


def rules_with(rates: Rates, min_step: int) -> CheckpointRules:
    costs = CostModel()
    costs.fix(rates)
    return CheckpointRules(min_step=min_step, costs=costs)


@given(st.integers(1, 64), st.lists(st.integers(1, 400), max_size=4, unique=True), st.integers(1, 500),
       st.integers(0, 500), st.integers(0, 400))
def test_with_cpu_like_rates_every_capture_is_taken_as_before(step: int, taken: list[int], position: int,
                                                               end_extra: int, branch: int) -> None:
    checkpoints = [partial(SWA, n) for n in sorted(taken)]
    prompt_end = position + end_extra
    plain_rules, weighed = CheckpointRules(min_step=step), rules_with(CPU_LIKE, step)
    assert want_checkpoint(SWA, weighed, checkpoints, position, prompt_end, 0, branch) == want_checkpoint(
        SWA, plain_rules, checkpoints, position, prompt_end, 0, branch)
    last = checkpoints[-1].n_tokens if checkpoints else 0
    start = min(last, position)
    assert pause_points(SWA, weighed, start, prompt_end, prompt_end, last, branch) == pause_points(
        SWA, plain_rules, start, prompt_end, prompt_end, last, branch)


@given(st.integers(1, 64), st.integers(1, 5000), st.integers(0, 500))
def test_a_capture_dearer_than_what_it_saves_is_neither_paused_for_nor_taken(step: int, position: int,
                                                                             extra: int) -> None:
    dear = Rates.flat(1e-6, latency=1e-6, bandwidth=1e9, partial_bytes=10 << 20)  # 20 ms to copy and restore
    rules = rules_with(dear, step)
    assert not want_checkpoint(SWA, rules, [], position, position + extra, 0, position)
    assert pause_points(SWA, rules, 0, position + extra, position + extra, 0, position) == []
    assert CheckpointRules(min_step=step).capture_pays(1)  # a fresh engine's CPU-like rates: every capture pays


# --- engines -----------------------------------------------------------------------------------------------------

GPU_LIKE = Rates.flat(1e-5, latency=0.010, bandwidth=1e9)
"""100,000 tokens a second; every restore pays 10 ms (a slow bus, a busy device)."""


@pytest.mark.parametrize("by_cost", [True, False])
def test_an_engine_recomputes_an_edit_when_restoring_is_slower(by_cost: bool) -> None:
    manager = fake_manager("swa", checkpoint_min_step=64, plan_by_cost=by_cost)
    manager.rules.costs.fix(CPU_LIKE)
    prompt = list(range(10, 410))
    run_prompt(manager, prompt, 2)
    assert [c.n_tokens for c in manager.primary.slot.checkpoints] == [64, 128, 192, 256, 320, 384, 400]
    manager.rules.costs.fix(GPU_LIKE)  # now a restore costs more than the evaluation it saves
    edited = prompt[:300] + [5] * 20
    evaluated = run_prompt(manager, edited, 2)
    costs = manager.stats()["costs"]
    if by_cost:
        # the checkpoint at 256 would save 256 tokens (2.6 ms) for a 10 ms restore
        assert evaluated == len(edited) + 2 and manager.counters.checkpoints_restored == 0
        assert costs["plans_by_cost"] == 1 and costs["tokens_recomputed_by_cost"] == 256
    else:
        assert evaluated == len(edited) - 256 + 2 and manager.counters.checkpoints_restored == 1
        assert costs["plans_by_cost"] == 0 and not costs["enabled"]
    # the memory's own limits are counted as before: the window had lost 256..300 either way
    assert manager.counters.forced_reprocess == 1 and manager.counters.tokens_reprocessed == 300 - 256
    assert not manager.primary.backend.corrupted and manager.primary.backend.memory[: len(edited)] == edited


def test_stats_and_metrics_show_rates_and_estimated_against_actual_time() -> None:
    manager = fake_manager("swa", checkpoint_min_step=64)
    prompt = list(range(10, 410))
    for turn in range(4):
        run_prompt(manager, prompt + [5] * turn, 2)
    costs = manager.stats()["costs"]
    assert costs["enabled"] and costs["eval_observations"]["32"] > 0 and costs["plans"] >= 3
    assert costs["transfers"]["capture"]["latency_observations"] > 0
    plan = costs["recent_plans"][-1]
    assert plan["estimated_seconds"] > 0 and plan["actual_seconds"] > 0 and plan["evaluated"] >= 1
    assert costs["time_ratio"]["count"] == costs["plans"] and costs["time_ratio"]["buckets"][-1][0] == "+Inf"
    text = Metrics(lambda: {"m": manager}).render().decode()
    assert 'ckpt_plan_time_ratio_bucket{le="1.0",model="m"}' in text
    assert f'ckpt_plan_time_ratio_count{{model="m"}} {float(costs["plans"])}' in text
    assert 'ckpt_eval_seconds_per_token{batch="32",model="m"}' in text
    assert 'ckpt_transfer_bytes_per_second{model="m",tier="shared"}' in text
    assert 'ckpt_plans_by_cost_total{model="m"} 0.0' in text


def test_a_plan_clock_records_its_outcome() -> None:
    costs = CostModel()
    costs.plan_record.add(PlanClock(estimated=0.010, prompt_end=100, n_keep=90, most_tokens=95, tier="shared",
                                    by_cost=True, fetches_skipped=1, seconds=0.012))
    view = costs.snapshot()
    assert view["plans"] == view["plans_by_cost"] == view["fetches_skipped_by_cost"] == 1
    assert view["tokens_recomputed_by_cost"] == 5
    assert view["recent_plans"][0]["ratio"] == pytest.approx(1.2) and view["recent_plans"][0]["evaluated"] == 10
    buckets = dict((str(bound), count) for bound, count in view["time_ratio"]["buckets"])
    assert buckets["1.1"] == 0 and buckets["1.25"] == 1
