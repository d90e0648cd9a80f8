"""A compressed radix tree over token ids: the index of every tier of the prompt cache.

A lookup walks the prompt once along the tree (a few vectorized edge comparisons) whatever the number of entries.
Indexed items only need their ``tokens`` and a ``_node`` slot where the index keeps their place.
"""

from __future__ import annotations

import itertools
from typing import Any, Generic, Iterator, Protocol, TypeVar

import numpy as np

from .policy import common_prefix


class Indexed(Protocol):
    """What the index needs of an item."""

    tokens: np.ndarray
    _node: Any


T = TypeVar("T", bound=Indexed)


class _Node(Generic[T]):
    __slots__ = ("edge", "children", "entry", "parent")

    def __init__(self, edge: np.ndarray, parent: _Node[T] | None) -> None:
        self.edge = edge
        self.children: dict[int, _Node[T]] = {}
        self.entry: T | None = None
        self.parent = parent


class RadixIndex(Generic[T]):
    """A compressed radix tree mapping token sequences to entries."""

    def __init__(self) -> None:
        self.root: _Node[T] = _Node(np.empty(0, dtype=np.int32), None)
        self.size = 0

    def insert(self, entry: T) -> T | None:
        """Index ``entry``; return the entry it replaces (same tokens), if any."""
        node, tokens, i = self.root, entry.tokens, 0
        while i < len(tokens):
            child = node.children.get(int(tokens[i]))
            if child is None:
                leaf = _Node(tokens[i:], node)
                node.children[int(tokens[i])] = leaf
                node = leaf
                i = len(tokens)
                break
            n = common_prefix(child.edge, tokens[i:])
            if n < len(child.edge):
                child = self._split(child, n)
            node, i = child, i + n
        replaced = node.entry
        if replaced is not None:
            replaced._node = None
        else:
            self.size += 1
        node.entry = entry
        entry._node = node
        return replaced

    @staticmethod
    def _split(node: _Node[T], n: int) -> _Node[T]:
        parent = node.parent
        assert parent is not None
        middle = _Node(node.edge[:n], parent)
        parent.children[int(node.edge[0])] = middle
        node.edge = node.edge[n:]
        node.parent = middle
        middle.children[int(node.edge[0])] = node
        return middle

    def remove(self, entry: T) -> None:
        """Remove ``entry`` and prune the nodes it leaves empty."""
        node = entry._node
        if node is None or node.entry is not entry:
            return
        node.entry = None
        entry._node = None
        self.size -= 1
        while node.parent is not None and node.entry is None and not node.children:
            parent = node.parent
            del parent.children[int(node.edge[0])]
            node = parent
        if node.parent is not None and node.entry is None and len(node.children) == 1:
            (only,) = node.children.values()
            only.edge = np.concatenate((node.edge, only.edge))
            only.parent = node.parent
            node.parent.children[int(only.edge[0])] = only

    def ancestors(self, entry: T) -> Iterator[T]:
        """Entries whose tokens are a strict prefix of ``entry``'s, deepest first."""
        node = entry._node.parent if entry._node is not None else None
        while node is not None:
            if node.entry is not None:
                yield node.entry
            node = node.parent

    def lookup(self, prompt: np.ndarray, max_candidates: int = 8) -> list[tuple[T, int]]:
        """Entries sharing the longest prefixes with ``prompt``, as ``(entry, common prefix length)``.

        Returns the deepest entry that is a prefix of ``prompt`` and up to ``max_candidates`` entries below the point
        where ``prompt`` leaves the tree (they all share exactly that many tokens with it), nearest first.
        """
        node, i = self.root, 0
        prefix_entry: tuple[T, int] | None = None
        stop: _Node | None = None
        while True:
            if node.entry is not None:
                prefix_entry = (node.entry, i)
            if i >= len(prompt):
                stop = node
                break
            child = node.children.get(int(prompt[i]))
            if child is None:
                stop = node
                break
            # The first token matched through the dict key; one-token edges (common near branch points) need no more.
            n = 1 if len(child.edge) == 1 else common_prefix(child.edge, prompt[i:])
            if n < len(child.edge):
                i += n
                stop = child
                break
            node, i = child, i + n
        found: list[tuple[T, int]] = []
        frontier = [stop]
        while frontier and len(found) < max_candidates:
            nxt: list[_Node] = []
            for current in frontier:
                if current.entry is not None and (prefix_entry is None or current.entry is not prefix_entry[0]):
                    found.append((current.entry, i))
                # Every subtree holds an entry, so a few children per node are enough: no scan of wide nodes.
                nxt.extend(itertools.islice(current.children.values(), max_candidates))
            frontier = nxt
        if prefix_entry is not None:
            found.insert(0, prefix_entry)
        return found[: max_candidates + 1]
