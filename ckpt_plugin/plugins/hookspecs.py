"""Hook specifications for ckpt_plugin.

Every decision and event of a :class:`~ckpt_plugin.engine.manager.CheckpointManager` goes through these hooks. The manager's
own behaviour is a plugin too (``ckpt_plugin.default``, registered last-called with ``trylast``), so a third-party
plugin registered through the ``ckpt_plugin`` entry-point group or ``manager.plugins.register(...)`` can observe every
event, veto a cache allocation, pick eviction victims or replace the checkpoint policy.

Conventions:

- ``manager`` is always the calling engine, a :class:`~ckpt_plugin.engine.manager.CheckpointManager` (typed as the
  :class:`~ckpt_plugin.plugins.view.EngineView` protocol); ``manager.controllers[slot.id]`` is the slot's
  controller, a :class:`~ckpt_plugin.plugins.view.SlotView` (its sequence, ``checkpoint()``, ``branch_point``).
- ``slot`` is the :class:`~ckpt_plugin.core.slot.Slot` concerned; treat it as read-only.
- Positions and token counts are in tokens from the start of the sequence.
- An exception raised by an implementation is re-raised as :class:`~ckpt_plugin.core.errors.PluginError` naming the plugin
  and the hook; the manager only calls hooks at points where the slot is consistent, so a failing plugin never leaves
  a half-restored slot behind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import pluggy

if TYPE_CHECKING:
    from ckpt_plugin.core.entry import CacheEntry
    from ckpt_plugin.core.checkpoint import Checkpoint, ExtraState, StateBuffer
    from ckpt_plugin.plugins.view import EngineView
    from ckpt_plugin.core.slot import Slot

__all__ = [
    "PROJECT_NAME",
    "checkpoint_wanted",
    "hookimpl",
    "hookspec",
    "on_attach",
    "on_cache_alloc",
    "on_cache_evict",
    "on_cache_hit",
    "on_capture_failed",
    "on_checkpoint_capture",
    "on_checkpoint_created",
    "on_checkpoint_erased",
    "on_detach",
    "on_full_reprocess",
    "on_prompt_processed",
    "on_slot_restore",
    "restored_extra",
    "select_cache_victims",
]

PROJECT_NAME = "ckpt_plugin"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# -------------------------------------------------------------------------------------------------------------------
# Life cycle
# -------------------------------------------------------------------------------------------------------------------


@hookspec
def on_attach(manager: EngineView) -> None:
    """Called once, when a manager has been attached to a host's model.

    Plugins use it to read the memory kind (``manager.kind``) or the settings, or to attach companion state (a
    draft model, a metrics registry).

    :param manager: The manager that was just attached.
    """


@hookspec
def on_detach(manager: EngineView) -> None:
    """Called once, when a manager is detached from its model.

    After this call the model is back to its own unpatched methods and the manager holds no checkpoints.

    :param manager: The manager being detached.
    """


# -------------------------------------------------------------------------------------------------------------------
# Prompt processing and checkpoint creation
# -------------------------------------------------------------------------------------------------------------------


@hookspec
def on_prompt_processed(
    manager: EngineView, slot: Slot, start: int, end: int, prompt_end: int
) -> None:
    """The host has evaluated the prompt tokens ``[start, end)`` of ``slot``.

    The manager evaluates a prompt in spans split at the positions where a checkpoint may be wanted, and calls this
    hook after each span, before the next one is decoded. The default plugin takes a checkpoint here when
    :func:`checkpoint_wanted` says so; other plugins observe (metrics, logging).

    :param manager: The calling manager.
    :param slot: The slot; ``slot.n_tokens == end`` during the call.
    :param start: First position of the span just evaluated.
    :param end: One past the last position evaluated; the memory now holds ``end`` tokens.
    :param prompt_end: Length of the whole prompt being processed (``end <= prompt_end``).
    """


@hookspec(firstresult=True)
def checkpoint_wanted(
    manager: EngineView, slot: Slot, position: int, prompt_end: int
) -> bool | None:
    """Decide whether a checkpoint should be taken now, with ``position`` tokens in memory.

    Stops at the first non-``None`` result. The default plugin answers last with the rules of
    :func:`ckpt_plugin.policy.schedule.want_checkpoint` (the step grid, the closing checkpoint, and the prompt's branch point,
    ``manager.controllers[slot.id].branch_point``); return ``True`` or ``False`` to replace them.

    :param manager: The calling manager.
    :param slot: The slot (``slot.n_tokens == position``).
    :param position: Number of tokens in memory.
    :param prompt_end: Length of the prompt being processed.
    :return: ``True`` to take a checkpoint, ``False`` not to, ``None`` to leave the decision to the next plugin.
    """


@hookspec
def on_checkpoint_capture(
    manager: EngineView, slot: Slot, n_tokens: int, partial: bool
) -> ExtraState | None:
    """Contribute companion state to a checkpoint being created (all results are collected).

    Called right after a checkpoint's target state was captured (a partial one, or a cache entry's full state). The
    result is stored with the checkpoint under its name (``checkpoint.extra[name]``) and travels with it through
    every tier (RAM, disk files, the shared tier), to come back in :func:`on_slot_restore`. A draft-model plugin returns
    ``ExtraState("draft", data)`` with its context's state, a speculative decoder ``ExtraState("speculative",
    data)``, any other plugin ``ExtraState("<its own name>", data)`` (see
    :data:`~ckpt_plugin.core.checkpoint.EXTRA_NAME`; one plugin per name: a name returned twice keeps the first answer).
    ``data`` must be a buffer the plugin will never mutate (it is frozen read-only here).

    Slots of one engine capture from their own threads: a plugin that keeps state of its own guards it.

    :param manager: The calling manager.
    :param slot: The slot being captured.
    :param n_tokens: Tokens in memory at capture time.
    :param partial: ``True`` for a partial checkpoint (only the part that cannot be truncated), ``False`` for a full
        state (the whole sequence: a cache entry's).
    :return: An :class:`~ckpt_plugin.core.checkpoint.ExtraState` or ``None``.
    """


@hookspec
def on_checkpoint_created(manager: EngineView, slot: Slot, checkpoint: Checkpoint) -> None:
    """A checkpoint was created and added to ``slot``.

    :param manager: The calling manager.
    :param slot: The slot that now holds the checkpoint.
    :param checkpoint: The new immutable checkpoint.
    """


@hookspec
def on_checkpoint_erased(manager: EngineView, slot: Slot, checkpoint: Checkpoint, reason: str) -> None:
    """A checkpoint was dropped from ``slot``.

    The checkpoint object stays valid for whoever else holds it (a cache entry, a saved state).

    :param manager: The calling manager.
    :param slot: The slot that dropped it.
    :param checkpoint: The checkpoint.
    :param reason: ``"limit"`` (over ``max_checkpoints``), ``"invalidated"`` (the new prompt diverged before its
        end) or ``"cleared"``.
    """


@hookspec
def on_capture_failed(manager: EngineView, slot: Slot, expected: int, written: int) -> None:
    """A state capture wrote fewer bytes than llama.cpp announced; no checkpoint was made.

    The request is still served; the counter ``capture_failures`` is incremented.

    :param manager: The calling manager.
    :param slot: The slot.
    :param expected: Bytes announced by ``llama_state_seq_get_size_ext``.
    :param written: Bytes actually written (0 on an allocation failure).
    """


# -------------------------------------------------------------------------------------------------------------------
# Restore
# -------------------------------------------------------------------------------------------------------------------


@hookspec
def on_slot_restore(
    manager: EngineView,
    slot: Slot,
    checkpoint: Checkpoint | None,
    entry: CacheEntry | None,
    n_tokens: int,
) -> None:
    """A checkpoint or prompt-cache entry was restored into ``slot``.

    Called after the target context was restored and truncated, before any new token is evaluated. A plugin that
    contributed extra state in :func:`on_checkpoint_capture` puts it back here: :func:`restored_extra` (``name``,
    ``checkpoint``, ``entry``) is the state stored with what was restored (the checkpoint's if one was, else the
    entry's full state's); a draft-model plugin restores its context from ``"draft"``, then the speculative state
    ``"speculative"``; observers record latency or counts.

    :param manager: The calling manager.
    :param slot: The slot, now holding ``n_tokens`` tokens.
    :param checkpoint: The partial checkpoint restored, or ``None``.
    :param entry: The prompt-cache entry whose full state was restored first, or ``None``.
    :param n_tokens: Tokens in memory after the restore.
    """


def restored_extra(name: str, checkpoint: Checkpoint | None, entry: CacheEntry | None) -> StateBuffer | None:
    """The extra state ``name`` stored with what :func:`on_slot_restore` restored: ``checkpoint``'s when a checkpoint
    was restored, else ``entry``'s full state's; ``None`` if that state has none of that name. (A helper for
    implementations, not a hook.)"""
    state = checkpoint if checkpoint is not None else entry.state if entry is not None else None
    return state.extra.get(name) if state is not None else None


@hookspec
def on_full_reprocess(manager: EngineView, slot: Slot, n_common: int, reason: str) -> None:
    """No memory, checkpoint or cache entry could serve the prompt's common prefix: it is evaluated again.

    :param manager: The calling manager.
    :param slot: The slot.
    :param n_common: Tokens the prompt shares with the memory that could not be reused.
    :param reason: Why (``"recurrent state cannot be truncated"``, ``"sliding window lost the prefix"``, ...).
    """


# -------------------------------------------------------------------------------------------------------------------
# Prompt cache
# -------------------------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def on_cache_alloc(manager: EngineView, namespace: str, n_tokens: int, n_bytes: int) -> bool | None:
    """The prompt cache is about to hold a new entry needing ``n_bytes`` more bytes.

    Stops at the first non-``None`` result. Return ``False`` to keep the entry out (a veto), ``True`` to admit it
    without asking later plugins; the default plugin admits everything that fits the budget. ``n_bytes`` counts only
    buffers no cache entry references yet (shared checkpoints are counted once; a slot may hold them already).

    :param manager: The calling manager.
    :param namespace: The tenant namespace of the entry.
    :param n_tokens: Tokens in the entry.
    :param n_bytes: New bytes the entry adds to the cache.
    :return: ``True``/``False``, or ``None`` to pass.
    """


@hookspec(firstresult=True)
def select_cache_victims(
    manager: EngineView, entries: Sequence[CacheEntry], n_bytes: int, tier: str
) -> Sequence[CacheEntry] | None:
    """Pick what to evict from a tier so that ``n_bytes`` more bytes fit its budget: RAM entries and disk-tier files
    alike (every eviction goes through :func:`ckpt_plugin.policy.eviction.evict_until`).

    Stops at the first non-``None`` result. The default plugin answers with the least recently used candidates
    (:func:`ckpt_plugin.policy.eviction.lru_victims`). The tier evicts the returned candidates in order, then asks again if
    the budget still does not fit; an answer that frees nothing means the new entry is not admitted (RAM) or not
    written (disk).

    :param manager: The calling manager.
    :param entries: Every evictable candidate, least recently used first: :class:`~ckpt_plugin.core.entry.CacheEntry`
        objects for ``"ram"``, :class:`~ckpt_plugin.tiers.disk.DiskRecord` objects for ``"disk"`` (both have
        ``nbytes``, ``n_tokens``, ``namespace`` and ``tokens``).
    :param n_bytes: Bytes still missing.
    :param tier: ``"ram"`` or ``"disk"``.
    :return: Candidates to evict, or ``None`` to pass.
    """


@hookspec
def on_cache_evict(manager: EngineView, entry: CacheEntry, reason: str) -> None:
    """An entry left the prompt cache.

    :param manager: The calling manager.
    :param entry: The entry (still valid for holders of a reference).
    :param reason: ``"budget"``, ``"replaced"`` (a newer entry serves what it served: a longer entry of its
        lineage, or a turn that went on from its last checkpoint) or ``"cleared"``.
    """


@hookspec
def on_cache_hit(manager: EngineView, slot: Slot, entry: CacheEntry, n_tokens: int) -> None:
    """A prompt-cache entry was chosen to serve a prompt (before it is restored).

    :param manager: The calling manager.
    :param slot: The slot it will be restored into.
    :param entry: The entry.
    :param n_tokens: Prompt tokens it serves.
    """
