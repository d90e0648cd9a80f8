"""ckpt_plugin's pytest plugin (the ``pytest11`` entry point): the fixtures of :mod:`ckpt_plugin.testing`.

pytest imports every installed ``pytest11`` plugin at start, in every project of the environment. This module
imports nothing but pytest; ckpt_plugin itself (numpy, pydantic, ... about a quarter of a second) is imported by a
fixture when a test uses it. It lives outside the ``ckpt_plugin`` package, whose ``__init__`` imports all of that.

- ``tiny_model``: ``tiny_model("gemma3") -> Path`` builds (once per session) a tiny random-weight GGUF model of a
  kind (``llama``, ``gemma3`` with a 32-token window, ``mamba``, ``hybrid``);
- ``fake_manager``: ``fake_manager(kind="swa", **settings) -> CheckpointManager`` over a
  :class:`ckpt_plugin.testing.FakeBackend`, for testing plugins without a model;
- ``hook_recorder``: a :class:`ckpt_plugin.testing.HookRecorder` that records every hook call of the managers it
  watches.
"""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING, Callable, Iterator

import pytest

if TYPE_CHECKING:
    from ckpt_plugin.engine.manager import CheckpointManager
    from ckpt_plugin.testing import HookRecorder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], pathlib.Path]:
    """``tiny_model(kind) -> Path``: a tiny GGUF model of ``kind``, built once per session."""
    from ckpt_plugin.testing import tiny_models_in

    return tiny_models_in(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(name="fake_manager")
def fake_manager_fixture() -> Callable[..., CheckpointManager]:
    """``fake_manager(kind="swa", **settings)``: a manager over a simulated context."""
    from ckpt_plugin.testing import fake_manager

    return fake_manager


@pytest.fixture
def hook_recorder() -> Iterator[HookRecorder]:
    """A fresh :class:`ckpt_plugin.testing.HookRecorder` (``hook_recorder.watch(manager)`` starts it)."""
    from ckpt_plugin.testing import HookRecorder

    yield HookRecorder()
