"""Dropping every state an attached Llama holds, so that none of its pages stays live in this process: what a
replica in another process, or this one after a restart, starts from."""

from __future__ import annotations

import gc
from typing import Any

import ckpt_plugin
from ckpt_plugin.core.pages import PAGES


def drop_states(llama: Any) -> set[bytes]:
    """Detach ``llama`` and drop every state it held; return the ids of the pages they held, none of them live any
    more."""
    manager = ckpt_plugin.manager_of(llama)
    held = [c for e in manager.cache.entries() for c in (e.state, *e.checkpoints)]
    held += manager.primary.slot.checkpoints  # before the detach, which lets go of them
    ckpt_plugin.detach(llama)
    ids = {page_id for c in held if c.paged for page_id in c.target.page_ids}
    manager.cache.clear()
    manager.close()
    del manager, held
    gc.collect()
    assert all(PAGES.get(page_id) is None for page_id in ids)
    return ids
