"""Captured states turned into pages (see :mod:`ckpt_plugin.core.pages`) before anything holds them.

A capture is parsed as llama.cpp laid it out, cut into pages named by the tokens they hold, and each page taken from
the process's page store where a live state holds it already: the capture's own buffer goes back to its pool, and
what stays is the manifest and the pages it added. A layout the parser does not know, or cells that do not sit at
the slot's positions, keep the capture whole (counted in ``states_kept_whole``; the first of each kind logged).
"""

from __future__ import annotations

import hashlib
import logging
import threading

import numpy as np

from ckpt_plugin.core.checkpoint import StateBuffer
from ckpt_plugin.core.counters import Counters
from ckpt_plugin.core.memory import MemoryKind
from ckpt_plugin.core.pages import PAGES, PagedState, PageStore, PageTally, TokenChain, page_state
from ckpt_plugin.core.state_layout import UnknownLayout, parse_state

__all__ = ["StatePager", "page_seed"]

log = logging.getLogger("ckpt_plugin")


def page_seed(fingerprint: str, namespace: str) -> bytes:
    """What every page id of a model's states in one tenant's namespace starts from: states of other models, other
    context settings or other tenants never share a page."""
    return hashlib.blake2b(f"{fingerprint}\0{namespace}".encode(), digest_size=16, person=b"ckpt-pages").digest()


class StatePager:
    """Pages the captures of one model's sequences.

    :param kind: The memory kind: a pure recurrent state, or a hybrid one's partial state, has no cells by position
        and is kept whole without a word.
    :param fingerprint: The model and context the states belong to (part of every page id).
    :param page_positions: Positions a page covers; 0 keeps every state whole.
    :param counters: Pages stored and shared, states kept whole.
    :param store: The live pages.
    """

    def __init__(self, kind: MemoryKind, fingerprint: str, page_positions: int, counters: Counters,
                 store: PageStore = PAGES) -> None:
        self.kind = kind
        self.fingerprint = fingerprint
        self.page_positions = page_positions
        self.counters = counters
        self.store = store
        self._seeds: dict[str, bytes] = {}
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def has_cells(self, partial: bool) -> bool:
        """Whether a state of this kind (partial or full) holds any cells by position."""
        return self.page_positions > 0 and self.kind.attention and not (partial and self.kind.recurrent)

    def page(self, buffer: StateBuffer, tokens: np.ndarray, namespace: str,
             partial: bool) -> StateBuffer | PagedState:
        """``buffer`` (a sequence state holding ``tokens`` at positions ``0..``) as pages, or itself when it cannot
        be paged."""
        if not self.has_cells(partial):
            return buffer
        try:
            layout = parse_state(buffer, recurrent=self.kind.recurrent)
        except UnknownLayout as exc:
            self._keep_whole(f"layout: {exc}")
            return buffer
        tally = PageTally()
        paged = page_state(buffer, layout, TokenChain(self._seed(namespace), tokens, self.page_positions, namespace),
                           self.store, self.page_positions, tally)
        if paged is None:
            self._keep_whole("cells outside the slot's positions")
            return buffer
        self.counters.add(pages_stored=tally.stored, pages_shared=tally.shared, page_bytes_stored=tally.bytes_stored,
                          page_bytes_shared=tally.bytes_shared)
        return paged

    def _seed(self, namespace: str) -> bytes:
        seed = self._seeds.get(namespace)
        if seed is None:
            seed = self._seeds[namespace] = page_seed(self.fingerprint, namespace)
        return seed

    def _keep_whole(self, why: str) -> None:
        self.counters.add(states_kept_whole=1)
        kind = why.split(":")[0]
        with self._lock:
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            log.warning("a captured state is kept whole, not paged (%s); later ones are counted in "
                        "states_kept_whole, not logged", why)
