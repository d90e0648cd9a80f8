"""The import path earlier releases documented for the hook specifications, ``hookspec`` and ``hookimpl``: :mod:`ckpt_plugin.plugins.hookspecs`."""

from ckpt_plugin.plugins import hookspecs as _home
from ckpt_plugin.plugins.hookspecs import (
    PROJECT_NAME,
    checkpoint_wanted,
    hookimpl,
    hookspec,
    on_attach,
    on_cache_alloc,
    on_cache_evict,
    on_cache_hit,
    on_capture_failed,
    on_checkpoint_capture,
    on_checkpoint_created,
    on_checkpoint_erased,
    on_detach,
    on_full_reprocess,
    on_prompt_processed,
    on_slot_restore,
    restored_extra,
    select_cache_victims,
)

# The names its home exports, no more (the home module is the one list of them).
__all__ = list(_home.__all__)
