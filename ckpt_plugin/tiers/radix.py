"""A compressed radix tree over token ids: the index of every tier of the prompt cache.

A lookup walks the prompt once along the tree whatever the number of entries. Edges and prompts are compared as
native ``int32`` bytes: a whole edge is one ``memcmp`` (``bytes.startswith``), and where the prompt leaves an edge a
binary search of such comparisons finds the token, so a lookup runs no per-token Python code and no numpy call
after converting the prompt (with the CPU caches cold, as between two decodes, each numpy call costs microseconds).
A prompt given as a Python list, as the host's tokenizer makes it, is packed once by ``struct``, the fastest
conversion CPython has for it; an array is converted by one ``tobytes``.
Edges are copies of their tokens (4 bytes per token, against megabytes per entry's state). Indexed items only need
their ``tokens`` and a ``_node`` slot where the index keeps their place.
"""

from __future__ import annotations

import itertools
import struct
from typing import Any, Generic, Iterator, Protocol, Sequence, TypeVar

import numpy as np

__all__ = ["RadixIndex"]

TOKEN = 4  # bytes per token id (int32)


class Indexed(Protocol):
    """What the index needs of an item."""

    tokens: np.ndarray
    _node: Any


T = TypeVar("T", bound=Indexed)


def token_bytes(tokens: np.ndarray | Sequence[int] | bytes) -> bytes:
    """``tokens`` as native ``int32`` bytes, the form the index compares."""
    if isinstance(tokens, bytes):
        return tokens
    if isinstance(tokens, np.ndarray):
        return np.asarray(tokens, dtype=np.int32).tobytes()
    return struct.pack(f"{len(tokens)}i", *tokens)


def common_tokens(edge: bytes, key: bytes, offset: int) -> int:
    """Tokens ``edge`` shares with ``key`` from byte ``offset`` on."""
    if key.startswith(edge, offset):
        return len(edge) // TOKEN
    # The prefix of ``lo`` tokens matches, the prefix of ``hi`` tokens does not.
    lo, hi = 0, min(len(edge), len(key) - offset) // TOKEN + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if key.startswith(edge[: mid * TOKEN], offset):
            lo = mid
        else:
            hi = mid
    return lo


class _Node(Generic[T]):
    __slots__ = ("edge", "children", "entry", "parent")

    def __init__(self, edge: bytes, parent: _Node[T] | None) -> None:
        self.edge = edge
        # Keyed by the first token's bytes: the prompt's own bytes are looked up without decoding them.
        self.children: dict[bytes, _Node[T]] = {}
        self.entry: T | None = None
        self.parent = parent


class RadixIndex(Generic[T]):
    """A compressed radix tree mapping token sequences to entries."""

    def __init__(self) -> None:
        self.root: _Node[T] = _Node(b"", None)
        self.size = 0

    def insert(self, entry: T) -> T | None:
        """Index ``entry``; return the entry it replaces (same tokens), if any."""
        node, key, offset = self.root, token_bytes(entry.tokens), 0
        while offset < len(key):
            first = key[offset : offset + TOKEN]
            child = node.children.get(first)
            if child is None:
                leaf = _Node(key[offset:], node)
                node.children[first] = leaf
                node = leaf
                break
            n = common_tokens(child.edge, key, offset)
            if n * TOKEN < len(child.edge):
                child = self._split(child, n)
            node, offset = child, offset + n * TOKEN
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
        middle = _Node(node.edge[: n * TOKEN], parent)
        parent.children[node.edge[:TOKEN]] = middle
        node.edge = node.edge[n * TOKEN :]
        node.parent = middle
        middle.children[node.edge[:TOKEN]] = node
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
            del parent.children[node.edge[:TOKEN]]
            node = parent
        if node.parent is not None and node.entry is None and len(node.children) == 1:
            (only,) = node.children.values()
            only.edge = node.edge + only.edge
            only.parent = node.parent
            node.parent.children[only.edge[:TOKEN]] = only

    def ancestors(self, entry: T) -> Iterator[T]:
        """Entries whose tokens are a strict prefix of ``entry``'s, deepest first."""
        node = entry._node.parent if entry._node is not None else None
        while node is not None:
            if node.entry is not None:
                yield node.entry
            node = node.parent

    def lookup(self, prompt: np.ndarray | Sequence[int] | bytes, max_candidates: int = 8) -> list[tuple[T, int]]:
        """Entries sharing the longest prefixes with ``prompt``, as ``(entry, common prefix length)``.

        Returns the deepest entry that is a prefix of ``prompt`` and up to ``max_candidates`` entries below the point
        where ``prompt`` leaves the tree (they all share exactly that many tokens with it), nearest first.

        :param prompt: Token ids: an array, a sequence of ints, or :func:`token_bytes` of them.
        """
        key = token_bytes(prompt)
        node, offset = self.root, 0
        prefix_entry: tuple[T, int] | None = None
        stop: _Node | None = None
        while True:
            if node.entry is not None:
                prefix_entry = (node.entry, offset // TOKEN)
            child = node.children.get(key[offset : offset + TOKEN]) if offset < len(key) else None
            if child is None:
                stop = node
                break
            n = common_tokens(child.edge, key, offset) * TOKEN
            if n < len(child.edge):
                offset += n
                stop = child
                break
            node, offset = child, offset + n
        found: list[tuple[T, int]] = []
        shared = offset // TOKEN
        frontier = [stop]
        while frontier and len(found) < max_candidates:
            nxt: list[_Node] = []
            for current in frontier:
                if current.entry is not None and (prefix_entry is None or current.entry is not prefix_entry[0]):
                    found.append((current.entry, shared))
                # Every subtree holds an entry, so a few children per node are enough: no scan of wide nodes.
                nxt.extend(itertools.islice(current.children.values(), max_candidates))
            frontier = nxt
        if prefix_entry is not None:
            found.insert(0, prefix_entry)
        return found[: max_candidates + 1]
