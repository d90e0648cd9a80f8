"""Publishing a slot to the shared tier after a response, so that another replica can continue the conversation."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpt_plugin.core.errors import CaptureError

if TYPE_CHECKING:
    from ckpt_plugin.plugins.view import EngineView

__all__ = ["publish"]


def publish(manager: EngineView) -> bool:
    """Publish ``manager``'s live slots to the shared tier, so that another replica can continue from them; call it
    after a response (``CheckpointMiddleware`` does, after every completion). Returns whether an entry was queued.

    Each capture happens now, under its slot's lock (a few milliseconds; the next request's own capture reuses it
    when the slot is parked); encoding and writing happen on the write-behind thread. A slot whose state was published
    already (same version and namespace) is skipped.
    """
    shared = manager.store.shared
    if shared is None or not shared.available:
        return False
    queued = False
    for controller in manager.controllers:
        if controller.busy:
            continue  # mid-generation: its own request publishes it when its response is sent
        with controller.lock:
            controller.reconcile()
            slot = controller.slot
            if slot.n_tokens < max(manager.settings.cache_min_tokens, shared.block_tokens):
                continue
            if not shared.publish_marker(controller, (slot.version, slot.namespace)):
                continue
            try:
                entry = controller.save()
            except CaptureError:
                continue
        queued = manager.store.publish(entry) or queued
    return queued
