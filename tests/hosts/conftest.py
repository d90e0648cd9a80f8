"""Fixtures of the host tests (llama-cpp-python's ``Llama`` and its chat handlers, attached)."""

from __future__ import annotations

import pathlib

import pytest

from ckpt_plugin.testing.tiny_models import write_tiny_mmproj


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The default tiny projector (output width 64, every tiny model's ``n_embd``)."""
    return write_tiny_mmproj(tmp_path_factory.mktemp("mmproj") / "mmproj.gguf")
