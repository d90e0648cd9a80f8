"""Parallel slots: N conversations at once over one ``Llama``'s weights, batched, with checkpoints per slot.

:class:`ParallelLlama` builds, for a host's ``Llama``:

- a :class:`~ckpt_plugin.hosts.llama_cpp.parallel.sequences.SequenceContext` with N sequences, each in a KV stream of
  its own of ``n_ctx`` cells (llama.cpp's server's layout with ``--parallel``): every slot holds a whole ``n_ctx``
  conversation (a request that fits one slot fits any, as with one), and a token attends over its own slot's cells
  only; or, with ``unified=True``, one pool of ``n_ctx`` cells the slots share, where a slot takes a prefix another
  live slot holds without evaluating it (:mod:`ckpt_plugin.hosts.llama_cpp.parallel.kv_sharing`);
- a :class:`~ckpt_plugin.hosts.llama_cpp.parallel.scheduler.BatchScheduler` decoding every busy slot's tokens together;
- one engine (:class:`~ckpt_plugin.engine.manager.CheckpointManager`) with one slot per sequence: checkpoints and cache
  entries are shared by reference between the slots and the tiers, so a conversation that moves to another slot
  restores from them;
- :meth:`ParallelLlama.view`: per request, a :class:`~ckpt_plugin.hosts.llama_cpp.parallel.slot_views.SlotLlama` on
  which the host runs its own completion and chat code. The view's attachment
  (:class:`~ckpt_plugin.hosts.llama_cpp.parallel.slot_attachment.SlotAttachment`) binds it to a slot when its
  generation starts, the point where the prompt's tokens are known: the idle slot sharing the longest prefix with them
  (:mod:`ckpt_plugin.hosts.llama_cpp.parallel.slot_choice`), leased until the generation ends. A multimodal chat handler
  (llava-1-5, mtmd, ...), which evaluates its prompt before the completion, leases the slot at its first evaluation
  instead: its text and media chunks go to that slot (an image decoded into the slot's sequence, keyed by its
  content as with one slot), and the generation takes the lease over
  (:mod:`ckpt_plugin.hosts.llama_cpp.parallel.slot_media`).

Speculative decoding: with a draft model (``draft=``), a draft context of N sequences whose drafting steps run in the
target scheduler's loop, every speculating slot's drafts in one batch per step, its state stored with the slot's
checkpoints
(:mod:`ckpt_plugin.hosts.llama_cpp.parallel.slot_drafts`); llama-cpp-python's prompt lookup decoding
(``LlamaPromptLookupDecoding`` as the host's ``draft_model``) gets an instance per slot.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp.llama import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

from ckpt_plugin.tiers.ram import PromptCache
from ckpt_plugin.core.config import CheckpointSettings
from ckpt_plugin.tiers.disk import DiskTier
from ckpt_plugin.core.errors import UnsupportedHostError
from ckpt_plugin.engine.manager import CheckpointManager
from ckpt_plugin.hosts.llama_cpp.parallel.slot_choice import SlotLeases
from ckpt_plugin.hosts.llama_cpp.parallel.kv_sharing import PrefixSharing
from ckpt_plugin.policy.plan import shares_cells
from ckpt_plugin.hosts.llama_cpp.parallel.slot_attachment import SlotAttachment
from ckpt_plugin.hosts.llama_cpp.parallel.slot_drafts import SlotDrafts
from ckpt_plugin.hosts.llama_cpp.seam import compat as host
from ckpt_plugin.hosts.llama_cpp.attachment.multimodal import is_mtmd_handler, relay_for_view
from ckpt_plugin.hosts.llama_cpp.parallel.scheduler import BatchScheduler
from ckpt_plugin.hosts.llama_cpp.parallel.sequences import SequenceContext
from ckpt_plugin.hosts.llama_cpp.parallel.slot_views import SlotLlama, view_of
from ckpt_plugin.hosts.llama_cpp.parallel.view_backend import ViewBackend

__all__ = ["ParallelLlama"]

log = logging.getLogger("ckpt_plugin")


class ParallelLlama:
    """``n_slots`` slots over ``llama``'s weights (see the module docstring).

    :param llama: The host's ``Llama``; it stays usable on its own context, which the slots do not use.
    :param n_slots: Slots (sequences), at least 1.
    :param settings: Checkpoint settings of the engine.
    :param cache: A prompt cache to share; :param disk: a disk tier to share.
    :param draft: A draft model for speculative decoding (same vocabulary): each slot drafts from its own sequence
        of a draft context (the slots compute the logits rows a verification samples, whatever ``logits_all``).
    :param n_draft: Tokens drafted per step with ``draft``.
    :param unified: One pool of ``n_ctx`` cells for all the slots (llama.cpp's ``kv_unified``, llama-server's
        ``--kv-unified``), each slot able to grow to the whole context, instead of a stream of ``n_ctx`` cells per
        slot; with plain attention, a prompt sharing a prefix with another slot's live memory takes over its cells
        (:mod:`ckpt_plugin.hosts.llama_cpp.parallel.kv_sharing`), and a prefix in flight is evaluated once.
    :ivar manager: The engine, one slot per sequence.
    :ivar leases: Which slot each generation holds.
    :ivar drafts: The slots' draft models (``None`` without ``draft``).
    :ivar lookups: A prompt lookup decoder per slot, where the host's ``draft_model`` is one.
    :ivar sharing: The prompts in flight, and the cells the slots share where they can (``unified`` and plain
        attention); ``None`` for a recurrent memory.
    :raises UnsupportedHostError: ``llama`` serves embeddings, or has a draft model other than prompt lookup.
    """

    def __init__(
        self,
        llama: Llama,
        n_slots: int,
        settings: CheckpointSettings | None = None,
        *,
        cache: PromptCache | None = None,
        disk: DiskTier | None = None,
        draft: Llama | None = None,
        n_draft: int = 4,
        unified: bool = False,
        **overrides: Any,
    ) -> None:
        host_draft = llama.draft_model
        if host_draft is not None and not isinstance(host_draft, LlamaPromptLookupDecoding):
            raise UnsupportedHostError("parallel slots take a draft model as ParallelLlama(draft=...), which gives "
                                       "each slot a sequence of its own; a Llama's draft_model has one")
        if draft is not None and host_draft is not None:
            raise UnsupportedHostError("a draft model and prompt lookup decoding cannot both draft")
        if llama.context_params.embeddings:
            raise UnsupportedHostError("embedding contexts have no generation state to checkpoint")
        if is_mtmd_handler(llama.chat_handler):
            # Loaded once, with the model, before any request: the views share it (each with a relay of its own).
            host.init_mtmd_context(llama.chat_handler, llama)
        self.llama = llama
        n_ctx = int(llama.n_ctx())
        self.context = SequenceContext(llama, n_slots, n_ctx=n_ctx if unified else n_ctx * n_slots, unified=unified)
        self.scheduler = BatchScheduler(self.context)
        self.backends = [ViewBackend(self.context, i, self.scheduler, llama) for i in range(n_slots)]
        self.manager = CheckpointManager(self.backends[0], settings, cache=cache, disk=disk,
                                         more_slots=self.backends[1:], **overrides)
        self.leases = SlotLeases(n_slots, self._describe)
        self.sharing: PrefixSharing | None = None
        cells = unified and shares_cells(self.context.kind)
        if not self.context.kind.recurrent:  # a recurrent state at a prompt's end serves no shorter prefix
            self.sharing = PrefixSharing(self.backends, self.manager.counters, self.manager.settings.cache_min_tokens,
                                         park=None if cells else self._park)
        if cells and self.sharing is not None:
            for controller in self.manager.controllers:
                controller.peers = self.sharing.peers(controller.slot.id)
        if unified:
            self.context.make_room = self._make_room
        self.lookups = [copy.copy(host_draft) for _ in range(n_slots)] if host_draft is not None else None
        self.drafts: SlotDrafts | None = None
        if draft is not None:
            self.drafts = SlotDrafts(draft, llama, self.scheduler, n_slots=n_slots, n_ctx=n_ctx, n_draft=n_draft)
            states = self.drafts.state_plugin()
            try:
                states.on_attach(self.manager)
            except BaseException:
                self.close()
                raise
            self.manager.plugins.register(states, name="ckpt_plugin.draft")
        self.manager.hooks.call(self.manager.hooks.hook.on_attach)

    @property
    def n_slots(self) -> int:
        return len(self.backends)

    def _describe(self, slot_id: int) -> tuple[str, np.ndarray]:
        slot = self.manager.controllers[slot_id].slot
        return slot.namespace, slot.tokens

    def _park(self, slot_id: int) -> None:
        """Put slot ``slot_id``'s state into the cache for the generations waiting for its prefix (on its thread)."""
        controller = self.manager.controllers[slot_id]
        try:
            if not controller.holds_outside_writes:
                controller.save_to_cache()
        except Exception:  # the waiters evaluate the prefix themselves
            log.exception("slot %d: its state could not be parked for the prompts waiting for it", slot_id)

    def _make_room(self) -> bool:
        """Park one idle slot's conversation in the cache and free its cells (the least recently used slot whose
        lock is free); ``False`` if none could be. Called for a full pool (:attr:`SequenceContext.make_room`) on the
        scheduler's thread or a restoring slot's, the context held: a slot's lock is only tried, never waited for
        (its owner may be waiting for this very step)."""
        for slot_id in self.leases.idle_oldest_first():
            controller = self.manager.controllers[slot_id]
            # A slot without tokens may still hold cells: the chunks of a prompt whose evaluation failed.
            empty = llama_cpp.llama_memory_seq_pos_max(self.context.memory, slot_id) < 0
            if empty or not controller.lock.acquire(blocking=False):
                continue
            try:
                if self.leases.busy(slot_id) or controller.busy:
                    continue
                log.info("slot %d: the pool of KV cells is full; its conversation goes to the cache", slot_id)
                if (controller.slot.n_tokens >= self.manager.settings.cache_min_tokens
                        and not controller.holds_outside_writes):
                    try:
                        controller.save_to_cache()
                    except Exception:  # the conversation is lost to the cache, not the step to the other slots
                        log.exception("slot %d: its state could not be parked", slot_id)
                controller.clear_slot()
                return True
            finally:
                controller.lock.release()
        return False

    def view(self) -> SlotLlama:
        """A view of the ``Llama`` for one request: the host's completion methods, on a slot leased per
        generation. Close the view when the request ends: a generation it left suspended frees its slot then."""
        view = view_of(self.llama, self.context)
        attachment = SlotAttachment(view, self)
        attachment.patch_methods()
        view.end_generations = attachment.end
        # A multimodal chat handler evaluates through this view's attachment (its own copy of the handler).
        view.chat_handler = relay_for_view(view.chat_handler, attachment)
        return view

    def busy(self, slot_id: int) -> bool:
        """Whether a generation holds ``slot_id`` now."""
        return self.leases.busy(slot_id)

    def close(self) -> None:
        """Close the engine, stop the scheduler and free the shared context."""
        self.manager.close()
        self.scheduler.close()
        self.context.close()
        if self.drafts is not None:
            self.drafts.close()
