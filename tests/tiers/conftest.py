"""Tier tests: every shared tier a test opens is closed when it ends, so that no writer or reconnect probe of it
outlives the test (a later test measuring allocations or threads would count them)."""

from __future__ import annotations

import weakref
from typing import Any, Iterator

import pytest

from ckpt_plugin.tiers.shared.tier import SharedTier


@pytest.fixture(autouse=True)
def close_shared_tiers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    opened: weakref.WeakSet[SharedTier] = weakref.WeakSet()
    real_init = SharedTier.__init__

    def recording_init(self: SharedTier, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        opened.add(self)

    monkeypatch.setattr(SharedTier, "__init__", recording_init)
    yield
    for tier in list(opened):
        tier.close(timeout=1.0)
