"""The tiers a cache entry can live in, by name."""

from __future__ import annotations

import enum


class Tier(str, enum.Enum):
    """Where an entry lives: a string enum, so ``Tier.RAM == "ram"`` (plans, hooks and JSON views use the names)."""

    RAM = "ram"
    DISK = "disk"
    SHARED = "shared"

    def __str__(self) -> str:
        return self.value
