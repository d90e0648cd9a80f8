"""Tests for ckpt_plugin.testing.tiny_models: the generated GGUFs load and run in llama.cpp."""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

from ckpt_plugin.testing.tiny_models import MODEL_KINDS, N_VOCAB, build_tiny_model  # noqa: E402

LLAMA_KWARGS: dict[str, Any] = dict(n_ctx=512, n_batch=64, n_ubatch=64, n_threads=2, verbose=False)
PROMPTS = (b"hello world", b"the cat and the dog", b"one two", b"is it that")
MAX_TOKENS = 16
PARTIAL_ONLY = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY


@contextlib.contextmanager
def load(path: pathlib.Path, **extra: Any) -> Iterator[Any]:
    llm = llama_cpp.Llama(model_path=str(path), **LLAMA_KWARGS, **extra)
    try:
        yield llm
    finally:
        llm.close()


def greedy(llm: Any, prompt: bytes) -> list[int]:
    """Greedy-generate MAX_TOKENS tokens; returns the tokens that were evaluated."""
    tokens = llm.tokenize(prompt)
    out = llm.create_completion(tokens, max_tokens=MAX_TOKENS, temperature=0)
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == MAX_TOKENS
    assert llm.n_tokens == len(tokens) + MAX_TOKENS - 1  # last sampled token is not evaluated
    return llm.input_ids[len(tokens) : llm.n_tokens].tolist()


def check_common(llm: Any) -> None:
    """Tokenizer, greedy generation and a 200-token evaluation."""
    tokens = llm.tokenize(b"hello world")
    assert tokens[0] == llm.token_bos()
    assert len(tokens) == 3  # <s> ▁hello ▁world
    assert llm.detokenize(tokens[1:]) == b" hello world"
    assert llm.n_vocab() == N_VOCAB

    generations = [greedy(llm, prompt) for prompt in PROMPTS]
    for generated in generations:
        assert len(set(generated)) >= 4, generated
    assert len({tuple(g) for g in generations}) == len(PROMPTS)

    llm.reset()
    rng = np.random.default_rng(1)
    llm.eval([llm.token_bos(), *rng.integers(3, N_VOCAB, size=199).tolist()])
    assert llm.n_tokens == 200
    memory = llama_cpp.llama_get_memory(llm.ctx)
    assert llama_cpp.llama_memory_seq_pos_max(memory, 0) == 199
    assert llama_cpp.llama_state_seq_get_size_ext(llm.ctx, 0, 0) > 0


def partial_state_size(llm: Any) -> int:
    return llama_cpp.llama_state_seq_get_size_ext(llm.ctx, 0, PARTIAL_ONLY)


def test_llama(tmp_path: pathlib.Path) -> None:
    with load(build_tiny_model("llama", tmp_path / "llama.gguf")) as llm:
        assert not llama_cpp.llama_model_is_recurrent(llm.model)
        assert not llama_cpp.llama_model_is_hybrid(llm.model)
        assert llama_cpp.llama_model_n_swa(llm.model) == 0
        check_common(llm)


@pytest.mark.parametrize("swa_full", [False, True])
@pytest.mark.parametrize("sliding_window", [32, 16])
def test_gemma3(tmp_path: pathlib.Path, swa_full: bool, sliding_window: int) -> None:
    path = build_tiny_model("gemma3", tmp_path / "gemma3.gguf", sliding_window=sliding_window)
    with load(path, swa_full=swa_full) as llm:
        assert not llama_cpp.llama_model_is_recurrent(llm.model)
        assert not llama_cpp.llama_model_is_hybrid(llm.model)
        assert llama_cpp.llama_model_n_swa(llm.model) == sliding_window
        check_common(llm)
        # PARTIAL_ONLY serialises just the SWA cache cells.
        assert 0 < partial_state_size(llm) < llama_cpp.llama_state_seq_get_size_ext(llm.ctx, 0, 0)


def test_mamba(tmp_path: pathlib.Path) -> None:
    with load(build_tiny_model("mamba", tmp_path / "mamba.gguf")) as llm:
        assert llama_cpp.llama_model_is_recurrent(llm.model)
        assert not llama_cpp.llama_model_is_hybrid(llm.model)
        check_common(llm)
        memory = llama_cpp.llama_get_memory(llm.ctx)
        assert llama_cpp.llama_memory_seq_pos_min(memory, 0) == 199  # only the latest state is kept
        assert partial_state_size(llm) > 0


def test_hybrid(tmp_path: pathlib.Path) -> None:
    with load(build_tiny_model("hybrid", tmp_path / "hybrid.gguf")) as llm:
        assert llama_cpp.llama_model_is_hybrid(llm.model)
        assert not llama_cpp.llama_model_is_recurrent(llm.model)
        check_common(llm)
        # PARTIAL_ONLY serialises just the recurrent (short-conv) state.
        assert 0 < partial_state_size(llm) < llama_cpp.llama_state_seq_get_size_ext(llm.ctx, 0, 0)


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_deterministic_and_small(tmp_path: pathlib.Path, kind: str) -> None:
    a = build_tiny_model(kind, tmp_path / "a.gguf", seed=3)
    b = build_tiny_model(kind, tmp_path / "b.gguf", seed=3)
    c = build_tiny_model(kind, tmp_path / "c.gguf", seed=4)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    assert a.stat().st_size < 4 * 1024 * 1024


def test_n_layer_override(tmp_path: pathlib.Path) -> None:
    with load(build_tiny_model("llama", tmp_path / "llama3.gguf", n_layer=3)) as llm:
        assert llama_cpp.llama_model_n_layer(llm.model) == 3


def test_unknown_kind(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny model kind"):
        build_tiny_model("gpt2", tmp_path / "x.gguf")
