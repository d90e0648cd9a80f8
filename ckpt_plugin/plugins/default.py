"""The manager's own behaviour as a plugin: checkpoint placement, admission and LRU victims (RAM and disk), called
last."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ckpt_plugin.policy.eviction import lru_victims
from ckpt_plugin.plugins.hookspecs import hookimpl
from ckpt_plugin.policy.schedule import want_checkpoint

if TYPE_CHECKING:
    from ckpt_plugin.core.entry import CacheEntry
    from ckpt_plugin.plugins.view import EngineView
    from ckpt_plugin.core.slot import Slot

__all__ = ["DEFAULT_PLUGIN_NAME", "DefaultPlugin"]

DEFAULT_PLUGIN_NAME = "ckpt_plugin.default"


class DefaultPlugin:
    """The manager's own behaviour, registered as ``ckpt_plugin.default`` and called last."""

    @hookimpl(trylast=True)
    def checkpoint_wanted(self, manager: EngineView, slot: Slot, position: int, prompt_end: int) -> bool:
        controller = manager.controllers[slot.id]
        return want_checkpoint(
            manager.kind, manager.rules, slot.checkpoints, position, prompt_end, controller.backend.pos_min(),
            controller.branch_point,
        )

    @hookimpl(trylast=True)
    def on_prompt_processed(
        self, manager: EngineView, slot: Slot, start: int, end: int, prompt_end: int
    ) -> None:
        if manager.hooks.call(manager.hooks.hook.checkpoint_wanted, slot=slot, position=end, prompt_end=prompt_end):
            manager.controllers[slot.id].checkpoint()

    @hookimpl(trylast=True)
    def on_cache_alloc(self, manager: EngineView, namespace: str, n_tokens: int, n_bytes: int) -> bool:
        return True

    @hookimpl(trylast=True)
    def select_cache_victims(self, entries: Sequence[CacheEntry], n_bytes: int) -> list[CacheEntry]:
        return lru_victims(entries, n_bytes)
