"""The checkpoint schedule: where prompt evaluation pauses and whether a checkpoint is taken there.

Pure, like :mod:`ckpt_plugin.policy.plan` (whose memory rules it uses): the engine pauses at :func:`pause_points` and the
default plugin decides at each pause with :func:`want_checkpoint`, over the same :class:`CheckpointRules`, the same
closing position (:func:`prompt_end_checkpoint`) and the same branch point (:func:`branch_point`). Both weigh a
checkpoint's copy against the evaluation it saves (:meth:`~ckpt_plugin.policy.costs.Rates.capture_pays`) with the rates the
rules carry, so a capture that costs more than it can save is neither paused for nor taken.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ckpt_plugin.core.checkpoint import Checkpoint
from ckpt_plugin.policy.costs import CostModel
from ckpt_plugin.core.memory import MemoryKind
from ckpt_plugin.policy.plan import Plan

__all__ = [
    "CheckpointRules",
    "branch_point",
    "default_min_step",
    "pause_points",
    "prompt_end_checkpoint",
    "want_checkpoint",
]


@dataclass(frozen=True, slots=True)
class CheckpointRules:
    """The knobs of checkpoint placement.

    :ivar max_checkpoints: Checkpoints kept per slot (llama.cpp's ``n_ctx_checkpoints``).
    :ivar min_step: Minimum spacing in tokens between two checkpoints taken inside a prompt.
    :ivar costs: The engine's measured rates (one model per engine, shared by its slots and its default plugin):
        placement skips a capture whose copy costs more than the evaluation it saves. A fresh model's rates are
        CPU-like, under which every capture pays.
    """

    max_checkpoints: int = 32
    min_step: int = 256
    costs: CostModel = field(default_factory=CostModel, compare=False, repr=False)

    def capture_pays(self, n_saved: int) -> bool:
        """Whether a checkpoint saving a later prompt ``n_saved`` tokens of evaluation is worth its copy (always,
        when plans are not weighed by cost)."""
        rates = self.costs.active_rates()
        return rates is None or rates.capture_pays(n_saved)


def default_min_step(kind: MemoryKind) -> int:
    """Checkpoint spacing when the settings leave it open: dense where checkpoints are small (recurrent states),
    sparser where they hold a sliding window."""
    return 64 if kind.recurrent else 256


def branch_point(kind: MemoryKind, rules: CheckpointRules, plan: Plan) -> int:
    """Where a checkpoint would let the next prompt with the same prefix restore all of it (0: nowhere).

    The prompt leaves what is stored at ``plan.n_shared`` (the end of a shared system prompt, an edit's position), and
    the plan keeps less than that, so the tokens between are evaluated again. A checkpoint where they end serves every
    later prompt that leaves there too, instead of the nearest ``min_step`` grid point below it. It costs a pause (a
    decode call of its own) and a checkpoint's bytes, so it is taken only where a later prompt would save at least
    half a ``min_step`` of evaluation, on a prefix of at least ``min_step`` tokens (not where a chat's next turn
    shares a few more tokens of the previous reply than the closing checkpoint holds).
    """
    step = max(1, rules.min_step)
    if not kind.needs_checkpoints or plan.n_shared < step or plan.n_shared - plan.n_keep < max(1, step // 2):
        return 0
    return plan.n_shared


def prompt_end_checkpoint(kind: MemoryKind, prompt_end: int) -> int:
    """Where the checkpoint that closes a prompt goes.

    A sliding-window checkpoint taken at the prompt's end serves both the continuations (``prompt_end`` tokens) and
    a regeneration of the same prompt (``prompt_end - 1``: one token is always evaluated), since a restored window
    can lose its last position (:func:`swa_threshold`); taking it there needs no pause, the prompt's last batch ends
    there. A recurrent state exists only at its end: the checkpoint goes one token before the end, so that both
    restore with one token to evaluate (llama.cpp takes them 4 and ``4 + n_ubatch`` tokens before the end).
    """
    return prompt_end - 1 if kind.recurrent else prompt_end


def want_checkpoint(
    kind: MemoryKind,
    rules: CheckpointRules,
    checkpoints: Sequence[Checkpoint],
    position: int,
    prompt_end: int,
    pos_min: int,
    branch: int = 0,
) -> bool:
    """Whether to take a checkpoint with ``position`` prompt tokens in memory.

    Taken only on memories that need checkpoints and where some are kept (``max_checkpoints`` above 0), never on an
    empty memory (``pos_min < 0``) nor past the prompt's end. At :func:`prompt_end_checkpoint` and at the prompt's
    ``branch`` point (:func:`branch_point`); elsewhere when at least ``min_step`` tokens past the newest checkpoint;
    in each case only if the capture pays for itself (:meth:`CheckpointRules.capture_pays`: always, unless copying
    is dearer than evaluating the tokens it saves).
    """
    if not kind.needs_checkpoints or rules.max_checkpoints == 0 or pos_min < 0 or position <= 0 \
            or position > prompt_end:
        return False
    if checkpoints and checkpoints[-1].n_tokens >= position:
        return False
    closing = prompt_end_checkpoint(kind, prompt_end)
    last = checkpoints[-1].n_tokens if checkpoints else 0
    if position > closing or (position not in (closing, branch) and position - last < rules.min_step):
        return False
    return rules.capture_pays(position - last)


def pause_points(
    kind: MemoryKind, rules: CheckpointRules, start: int, end: int, prompt_end: int, last_checkpoint: int,
    branch: int = 0,
) -> list[int]:
    """Positions inside ``(start, end)`` where prompt evaluation pauses so that a checkpoint may be taken.

    Every ``min_step`` tokens from the newest checkpoint inside the prompt, and where :func:`prompt_end_checkpoint`
    puts the closing checkpoint when that is not the end of the evaluation. A pause costs a decode call of its own
    (on Gemma-3-270M, splitting a 512-token batch in two costs about 35 ms, 4% of the batch; a lone last token
    22 ms): sliding-window prompts therefore close without one, while the ``min_step`` grid stays, since a coarser
    one (llama.cpp's batch boundaries) would double the average re-evaluation after an edit.

    :param last_checkpoint: ``n_tokens`` of the slot's newest checkpoint (0 if none).
    :param branch: The prompt's :func:`branch_point` (0 if none), a pause of its own.
    """
    if not kind.needs_checkpoints or rules.max_checkpoints == 0 or end - start < 2:
        return []
    points: set[int] = set()
    step = max(1, rules.min_step)
    closing = prompt_end_checkpoint(kind, prompt_end)
    pending_branch = start < branch < min(end, closing)
    next_point = max(last_checkpoint, 0) + step
    while next_point < min(end, prompt_end):
        if pending_branch and branch <= next_point:
            # The grid goes on from the branch checkpoint (its spacing is checked from the newest checkpoint).
            points.add(branch)
            pending_branch = False
            next_point = branch + step
            continue
        if next_point > start:
            points.add(next_point)
        next_point += step
    if pending_branch:
        points.add(branch)
    if start < closing < end:
        points.add(closing)
    # No pause for a capture that would not pay for itself (want_checkpoint would decline it).
    kept, previous = [], max(last_checkpoint, 0)
    for point in sorted(points):
        if rules.capture_pays(point - previous):
            kept.append(point)
            previous = point
    return kept


