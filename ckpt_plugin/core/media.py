"""Media positions as token ids: how a prompt with images or audio is keyed, matched and stored.

llama.cpp's server keeps each media chunk of a prompt with an id derived from its content and compares prompts chunk
by chunk. Here every store, index and file is keyed by arrays of token ids, so a media chunk of ``n`` positions is
written as ``n`` ids derived from a digest of its content (and of the projector that encodes it): negative numbers,
which no vocabulary uses. Two prompts then share a prefix through an image exactly when they hold the same image
at the same place, with every structure of the engine unchanged (radix index, cache entries, slot files, the shared
tier; no format changes: the ids are int32 like any token's). The engine never evaluates such an id as a token: only
the media chunk itself fills those positions.

Each position's id is 31 bits of a hash of the digest and the position, so two different images agree on one
position with probability 2**-31 and on a whole chunk never in practice; a prefix that ends inside an image is
cut back to the image's start (:func:`media_start`).
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["is_media", "media_digest", "media_start", "media_token_ids"]

_MASK_31 = np.uint64((1 << 31) - 1)


def media_digest(kind: str, projector: str, width: int, height: int, data: bytes | memoryview) -> str:
    """The key of one media input: a SHA-256 of its decoded content, its size, its kind and the projector's digest
    (the same picture encoded by another projector is another state)."""
    digest = hashlib.sha256()
    digest.update(f"{kind}:{projector}:{width}x{height}:".encode())
    digest.update(data)
    return digest.hexdigest()


def _mix(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer, vectorized (wrapping uint64 arithmetic)."""
    z = values + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def media_token_ids(key: str, n_positions: int) -> np.ndarray:
    """The ids standing for the ``n_positions`` positions of the media chunk ``key``: int32, all negative."""
    seed = np.uint64(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little"))
    with np.errstate(over="ignore"):
        mixed = _mix(np.arange(n_positions, dtype=np.uint64) ^ seed)
    return -(1 + (mixed & _MASK_31).astype(np.int64)).astype(np.int32)


def is_media(tokens: np.ndarray) -> np.ndarray:
    """Which entries of ``tokens`` stand for media positions."""
    return np.asarray(tokens) < 0


def media_start(spans: list[tuple[int, int]], n_keep: int) -> int:
    """``n_keep``, moved back to the start of the media chunk it falls inside (a media chunk is evaluated whole).

    :param spans: ``(start, end)`` of each media chunk of the prompt.
    """
    for start, end in spans:
        if start < n_keep < end:
            return start
    return n_keep
