"""Names kept for one release after a rename (docs/hooks.md, "Deprecated names"): each use warns with a
``DeprecationWarning`` that names the new name, then does what the new name does."""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["Renamed", "warn_renamed"]


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated in favour of ``new`` (``stacklevel`` counted from the caller's caller)."""
    warnings.warn(f"{old} is deprecated: use {new}", DeprecationWarning, stacklevel=stacklevel)


class Renamed:
    """A class attribute standing for the attribute it was renamed to: reading it on an instance warns, then gives
    the new attribute (a bound method, for a method).

    :param new: The attribute's name now.
    """

    def __init__(self, new: str) -> None:
        self.new = new
        self.old = ""
        self.owner = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.old, self.owner = name, owner.__name__

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        warn_renamed(f"{self.owner}.{self.old}", f"{self.owner}.{self.new}")
        return getattr(instance, self.new)
