"""Pure checkpoint policy and the planner, without a model."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from ckpt_plugin.policy.eviction import SLOT_BUDGET_SHARE, checkpoints_to_erase, slot_checkpoint_limit
from ckpt_plugin.core.memory import MemoryKind, common_prefix
from ckpt_plugin.policy.plan import (
    Hit,
    LiveMemory,
    best_reuse,
    can_truncate,
    checkpoint_serves,
    plan_prompt,
)
from ckpt_plugin.policy.schedule import CheckpointRules, branch_point, pause_points, prompt_end_checkpoint, want_checkpoint

from support.factories import Stored, checkpoint, window_checkpoint
from support.strategies import KINDS, stored, tokens


@given(st.integers(0, 64), st.integers(0, 1 << 30), st.integers(0, 1 << 26))
def test_slot_limit_keeps_the_slot_within_its_share_of_the_budget(max_checkpoints: int, budget: int,
                                                                  size: int) -> None:
    limit = slot_checkpoint_limit(max_checkpoints, budget, size)
    if budget == 0 or size == 0:
        assert limit == max_checkpoints
        return
    assert 1 <= limit <= max(1, max_checkpoints)
    # within the slot's share, unless one checkpoint alone is more (the newest is always kept)
    assert limit * size <= budget // SLOT_BUDGET_SHARE or limit == 1


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=40, unique=True), st.integers(0, 40))
def test_erasing_keeps_the_newest_and_at_most_limit(positions: list[int], limit: int) -> None:
    checkpoints = [checkpoint(n) for n in sorted(positions)]
    erased = checkpoints_to_erase(checkpoints, limit)
    kept = [c for c in checkpoints if c not in erased]
    assert len(kept) == min(len(checkpoints), limit)
    if limit:
        assert kept[-1] is checkpoints[-1]


# --- the planner -----------------------------------------------------------------------------------------------------

@given(st.data())
def test_plan_is_the_best_of_live_memory_and_candidates_and_fetches_only_what_can_win(data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(KINDS))
    prompt = np.asarray(data.draw(tokens), dtype=np.int32)
    live_stored = data.draw(stored(kind))
    n_memory = data.draw(st.integers(0, live_stored.n_tokens))
    live = LiveMemory(live_stored.tokens, n_memory, live_stored.pos_min, live_stored.checkpoints)
    candidates = data.draw(st.lists(stored(kind), max_size=5))
    tiers = data.draw(st.lists(st.sampled_from(["ram", "disk"]), min_size=len(candidates), max_size=len(candidates)))
    fetched: list[int] = []

    def fetcher(i: int):  # type: ignore[no-untyped-def]
        def fetch() -> Stored | None:
            fetched.append(i)
            return candidates[i]
        return fetch

    limit = max(len(prompt) - 1, 0)
    bounds = [int(common_prefix(c.tokens, prompt)) for c in candidates]
    hits = [Hit(tiers[i], bounds[i], fetcher(i)) for i in range(len(candidates))]
    plan = plan_prompt(kind, prompt, live, hits, min_discard=3, min_tokens=2)

    def reuse(c: Stored, n: int):  # type: ignore[no-untyped-def]
        return best_reuse(kind, c.tokens, n, c.pos_min, c.checkpoints, prompt, limit)

    live_best = reuse(live_stored, n_memory).n_keep
    best = max([live_best, *(reuse(c, c.n_tokens).n_keep for c in candidates)])
    assert plan.n_keep == best <= limit
    assert plan.live.n_keep == live_best
    if plan.entry is None:
        assert plan.n_keep == live_best and plan.tier is None
    else:
        i = candidates.index(plan.entry)
        assert plan.tier == tiers[i] and plan.n_keep > live_best  # ties go to the live memory
        assert reuse(plan.entry, plan.entry.n_tokens).n_keep == best
        assert plan.restore_state == (not (kind.partial_is_complete and plan.checkpoint is not None))
    # a hit is fetched only if its bound could beat what was kept when it came up
    for i in fetched:
        assert min(bounds[i], limit) > live_best
    kept_live = plan.n_keep if plan.entry is None else 0
    assert plan.park_live == (n_memory - kept_live >= 3 and n_memory >= 2)
    # the shared prefix is the longest any base holds, within the limit; a branch point only where it is not kept
    assert plan.n_shared == min(max([int(common_prefix(live_stored.tokens, prompt)), *bounds]), limit) >= plan.n_keep
    rules = CheckpointRules(min_step=data.draw(st.integers(1, 6)))
    point = branch_point(kind, rules, plan)
    wanted = (kind.needs_checkpoints and plan.n_shared - plan.n_keep >= max(1, rules.min_step // 2)
              and plan.n_shared >= rules.min_step)
    assert point == (plan.n_shared if wanted else 0)


def test_a_candidate_that_is_gone_is_skipped() -> None:
    kind = MemoryKind()
    prompt = np.asarray([1, 2, 3, 4, 5], dtype=np.int32)
    live = LiveMemory(np.zeros(0, dtype=np.int32), 0, 0, ())
    kept = Stored(np.asarray([1, 2, 3], dtype=np.int32), 0)
    plan = plan_prompt(kind, prompt, live, [Hit("disk", 4, lambda: None), Hit("ram", 3, lambda: kept)], 16, 32)
    assert plan.entry is kept and plan.tier == "ram" and plan.n_keep == 3


SWA = MemoryKind(n_swa=32)
RECURRENT = MemoryKind(recurrent=True, attention=False)
HYBRID = MemoryKind(recurrent=True)


def visible_from(kind: MemoryKind, position: int) -> int:
    """The oldest position the token at ``position`` attends to (llama.cpp: masked when ``p1 - p0 >= n_swa``)."""
    return max(0, position - kind.n_swa + 1)


@given(st.integers(1, 5000), st.integers(0, 5000))
def test_a_window_is_truncatable_exactly_while_it_holds_what_the_next_token_sees(n_memory: int, n_keep: int) -> None:
    n_keep = min(n_keep, n_memory - 1)
    restored_pos_min = SWA.restored_pos_min(0, n_memory - 1)
    expected = n_keep == 0 or restored_pos_min <= visible_from(SWA, n_keep)  # emptying is always possible
    assert can_truncate(SWA, n_memory, restored_pos_min, n_keep) == expected
    # a restored window loses at most its last position
    assert can_truncate(SWA, n_memory, restored_pos_min, n_memory - 1)
    assert not can_truncate(SWA, n_memory, restored_pos_min, n_memory - 2) or restored_pos_min == 0 or n_memory == 2


@given(st.integers(40, 3000))
def test_the_closing_checkpoint_serves_the_continuation_and_the_regeneration(prompt_end: int) -> None:
    for kind in (SWA, RECURRENT, HYBRID):
        closing = prompt_end_checkpoint(kind, prompt_end)
        taken = checkpoint(closing, pos_min=kind.restored_pos_min(0, closing - 1))
        # a regeneration keeps at most prompt_end - 1 tokens; a continuation shares prompt_end
        assert checkpoint_serves(kind, taken, prompt_end - 1) == prompt_end - 1
        assert checkpoint_serves(kind, taken, prompt_end + 20) == closing
        assert want_checkpoint(kind, CheckpointRules(min_step=256), [], closing, prompt_end, 0)
        assert not want_checkpoint(kind, CheckpointRules(min_step=256), [], prompt_end + 1, prompt_end, 0)
    assert prompt_end_checkpoint(SWA, prompt_end) == prompt_end  # no pause: the prompt's last batch ends there


@given(st.integers(0, 4000), st.integers(1, 4000), st.integers(0, 200), st.sampled_from([0, 64, 256, 512, 1024]))
def test_window_prompts_pause_on_the_step_grid_and_close_without_a_pause(start: int, length: int, extra: int,
                                                                        last: int) -> None:
    end = start + length
    prompt_end = end - min(extra, length - 1)
    last = min(last, start)
    step = 256
    points = pause_points(SWA, CheckpointRules(min_step=step), start, end, prompt_end, last)
    assert points == sorted(set(points)) and all(start < p < end for p in points)
    assert [p for p in points if p != prompt_end] == [p for p in range(last + step, prompt_end, step) if p > start]
    assert (prompt_end in points) == (prompt_end < end)  # only a generation in the same call needs that pause


@given(st.integers(0, 2000), st.integers(2, 2000), st.sampled_from([16, 64]))
def test_recurrent_pauses_keep_the_step_grid_and_close_one_token_early(start: int, length: int, step: int) -> None:
    end = start + length
    points = pause_points(RECURRENT, CheckpointRules(min_step=step), start, end, end, 0)
    assert set(range(step, end, step)) & set(range(start + 1, end)) <= set(points)
    assert (end - 1 in points) == (start < end - 1)


@given(st.integers(0, 3000), st.integers(2, 3000), st.integers(1, 3000), st.sampled_from([SWA, RECURRENT]))
def test_a_branch_point_is_a_pause_and_a_checkpoint_and_the_grid_goes_on_from_it(start: int, length: int,
                                                                              branch: int, kind: MemoryKind) -> None:
    end = start + length
    step = 64
    rules = CheckpointRules(min_step=step)
    closing = prompt_end_checkpoint(kind, end)
    points = pause_points(kind, rules, start, end, end, 0, branch)
    inside = start < branch < closing
    # (a branch point outside may still be a pause of its own: the grid's or the closing one)
    assert (branch in points) == inside or branch in range(step, end, step) or branch == closing
    if inside:
        assert [p for p in points if branch < p < closing] == list(range(branch + step, closing, step))
        # taken even right after a grid checkpoint; never past the closing one, nor at or below the newest one
        assert want_checkpoint(kind, rules, [checkpoint(branch - 1)], branch, end, 0, branch)
        assert not want_checkpoint(kind, rules, [checkpoint(branch - 1)], branch, end, 0, 0) or step == 1
        assert not want_checkpoint(kind, rules, [checkpoint(branch)], branch, end, 0, branch)
    assert all(start < p < end for p in points) and points == sorted(set(points))
