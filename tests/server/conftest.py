"""Fixtures of the server tests (ckpt-serve and plain llama_cpp.server as real subprocesses over HTTP)."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from support.servers import Server, model_args, run_server


@pytest.fixture(scope="module")
def plain(tiny_model: Any) -> Iterator[Server]:
    """Plain llama_cpp.server (no plugin) on the tiny llama: the answers of a fresh context."""
    with run_server(model_args(tiny_model("llama")), plain=True) as server:
        yield server
