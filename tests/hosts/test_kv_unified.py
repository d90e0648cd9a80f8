"""Parallel slots over one unified KV cache (``ParallelLlama(unified=True)``): one pool of ``n_ctx`` cells, prefixes
shared between live slots with ``llama_memory_seq_cp`` (plain attention only), prefixes in flight evaluated once;
every answer equal to the same request on a fresh context at temperature 0."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import pytest

from ckpt_plugin.hosts.llama_cpp.parallel.parallel_llama import ParallelLlama
from ckpt_plugin.core.memory import common_prefix

WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]


def fresh(plain: Any, text: str, max_tokens: int = 8) -> str:
    """The answer of a fresh context: the plain ``Llama`` forgets what it evaluated before (its whole memory is
    evaluated again)."""
    plain.reset()
    return plain.create_completion(text, max_tokens=max_tokens, temperature=0.0)["choices"][0]["text"]


def served(parallel: ParallelLlama, text: str, max_tokens: int = 8) -> str:
    view = parallel.view()
    try:
        return view.create_completion(text, max_tokens=max_tokens, temperature=0.0)["choices"][0]["text"]
    finally:
        view.end_generations()


def served_together(parallel: ParallelLlama, texts: list[str]) -> list[str]:
    """``texts`` served from concurrent clients, the context held (no step, no prepare) until the slots are leased
    and all but one of the first requests wait for the prefix in flight: the leases do not depend on how fast the
    threads start."""
    counters = parallel.manager.counters
    with ThreadPoolExecutor(len(texts)) as pool:
        with parallel.context.lock:
            futures = [pool.submit(served, parallel, text) for text in texts]
            for _ in range(2000):
                if counters.prefix_waits >= parallel.n_slots - 1:
                    break
                threading.Event().wait(0.01)
        return [future.result() for future in futures]


def references(plain: Any, texts: list[str]) -> tuple[list[str], list[np.ndarray], int]:
    """Fresh contexts' answers to ``texts``, their tokens, and the prefix all of them share."""
    tokenized = [np.asarray(plain.tokenize(text.encode())) for text in texts]
    return [fresh(plain, text) for text in texts], tokenized, min(common_prefix(tokenized[0], t) for t in tokenized)


def edited_prompts(n: int, seed: int) -> list[str]:
    """``n`` prompts around one shared prefix: some continue it, some cut it at a random word and go on
    elsewhere, some change one word in it, some share nothing."""
    rng = np.random.default_rng(seed)
    base = list(rng.choice(WORDS, 100))
    texts = []
    for _ in range(n):
        words = list(base)
        edit = rng.integers(4)
        if edit == 1:
            words = words[: int(rng.integers(10, len(words)))]
        elif edit == 2:
            words[int(rng.integers(len(words)))] = str(rng.choice(WORDS))
        elif edit == 3:
            words = list(rng.choice(WORDS, 40))
        texts.append(" ".join(words + list(rng.choice(WORDS, int(rng.integers(1, 12))))))
    return texts


def test_one_pool_of_n_ctx_cells_each_slot_able_to_hold_all_of_it(make_llama: Callable[..., Any]) -> None:
    host = make_llama("llama")
    parallel = ParallelLlama(host, 4, unified=True, load_entrypoints=False)
    try:
        assert parallel.context.unified
        assert parallel.context.n_ctx == host.n_ctx()
        assert all(backend.n_ctx == host.n_ctx() for backend in parallel.backends)
        assert parallel.sharing is not None
    finally:
        parallel.close()


def test_sixteen_agents_with_one_long_prompt_hold_it_once(make_llama: Callable[..., Any]) -> None:
    """Sixteen requests, four slots, one ~350-token tool prompt: it is evaluated once; every other request takes
    its cells from a live slot (seq_cp), and every answer is a fresh context's."""
    plain = make_llama("llama")
    host = make_llama("llama")
    rng = np.random.default_rng(7)
    tools = " ".join(rng.choice(WORDS, 75))
    texts = [f"{tools} user {i} asks {' '.join(rng.choice(WORDS, 3 + i % 5))}" for i in range(16)]
    expected, tokenized, prefix = references(plain, texts)
    parallel = ParallelLlama(host, 4, unified=True, load_entrypoints=False)
    try:
        got = served_together(parallel, texts)
        assert got == expected
        counters = parallel.manager.counters
        # Prompt tokens evaluated: the shared prefix once, then each request's own suffix (one token at least).
        evaluated = counters.prompt_tokens - counters.tokens_reused
        assert evaluated <= prefix + sum(len(t) - prefix for t in tokenized), parallel.manager.stats()
        assert counters.kv_shares >= 3 and counters.tokens_shared >= 3 * prefix, parallel.manager.stats()
    finally:
        parallel.close()


@pytest.mark.parametrize("kind", ["llama", "gemma3", "mamba", "hybrid"])
def test_random_shared_and_edited_prefixes_on_concurrent_slots_equal_fresh_contexts(
        make_llama: Callable[..., Any], kind: str) -> None:
    """A property over random prompts around one prefix (continued, cut, edited in the middle, unrelated), sent
    from concurrent clients in two rounds: every answer equals a fresh context's. Plain attention shares cells
    between slots; the other kinds (a sliding window, recurrent states) refuse to: nothing shared, same answers."""
    # The three slots busy at once fit the pool together (<= 3 x 540 cells); idle ones are parked when it is full.
    plain = make_llama(kind, n_ctx=2048)
    host = make_llama(kind, n_ctx=2048)
    parallel = ParallelLlama(host, 3, unified=True, load_entrypoints=False)
    try:
        for seed in (1, 2, 3, 4):
            texts = edited_prompts(8, seed)
            expected = [fresh(plain, text, 6) for text in texts]
            with ThreadPoolExecutor(8) as pool:
                got = list(pool.map(lambda text: served(parallel, text, 6), texts))
            assert got == expected, (seed, parallel.manager.stats())
        counters = parallel.manager.counters
        # On the tiny llama the slots share cells whenever a busy slot holds more of a prompt than the idle slot
        # it lands on (how often depends on the threads' timing: the tests above count shares deterministically).
        if kind != "llama":
            assert all(controller.peers is None for controller in parallel.manager.controllers)
            assert counters.kv_shares == 0, parallel.manager.stats()
            if kind in ("mamba", "hybrid"):
                assert parallel.sharing is None and counters.prefix_waits == 0
    finally:
        parallel.close()


@pytest.mark.parametrize("kind, unified", [("llama", True), ("llama", False), ("gemma3", True), ("gemma3", False)])
def test_requests_arriving_with_one_new_prefix_evaluate_it_once(
        make_llama: Callable[..., Any], kind: str, unified: bool) -> None:
    """Four requests with the same new prefix, all leased before any step runs (the test holds the context): one
    evaluates the prefix, the three others wait for it (``prefix_waits``) and share its cells (a unified cache,
    plain attention) or restore the state it parked in the cache (a stream per slot, or a sliding window)."""
    # A pool of 2,048 cells: four ~330-token prompts fit it without shared cells.
    plain = make_llama(kind, n_ctx=2048)
    host = make_llama(kind, n_ctx=2048)
    rng = np.random.default_rng(11)
    prefix_text = " ".join(rng.choice(WORDS, 70))
    texts = [f"{prefix_text} question {i}" for i in range(4)]
    expected, tokenized, prefix = references(plain, texts)
    parallel = ParallelLlama(host, 4, unified=unified, load_entrypoints=False)
    counters = parallel.manager.counters
    try:
        got = served_together(parallel, texts)
        assert got == expected
        assert counters.prefix_waits == 3
        if kind == "llama" and unified:
            assert counters.kv_shares == 3 and counters.tokens_shared >= 3 * prefix, parallel.manager.stats()
        else:
            assert counters.kv_shares == 0 and counters.cache_hits == 3, parallel.manager.stats()
        evaluated = counters.prompt_tokens - counters.tokens_reused
        assert evaluated <= prefix + sum(len(t) - prefix for t in tokenized), parallel.manager.stats()
    finally:
        parallel.close()


def test_a_full_pool_parks_an_idle_slot_and_restores_it_later(make_llama: Callable[..., Any]) -> None:
    """Two slots over a pool of 1,024 cells, conversations of ~600 tokens each: the second needs the first's cells
    (parked in the cache, freed), and the first, back, is restored from the cache, which needs the second's; the
    answers are a fresh context's."""
    plain = make_llama("llama")
    host = make_llama("llama")
    rng = np.random.default_rng(5)
    first, second = (" ".join(rng.choice(WORDS, 125)) for _ in range(2))
    expected, _, _ = references(plain, [first, second, first + " again"])
    parallel = ParallelLlama(host, 2, unified=True, load_entrypoints=False)
    counters = parallel.manager.counters
    try:
        got = [served(parallel, text) for text in (first, second, first + " again")]
        assert got == expected
        assert counters.cache_saves >= 2 and counters.cache_hits >= 1, parallel.manager.stats()
        assert counters.restore_failures == 0, parallel.manager.stats()
    finally:
        parallel.close()


def test_cells_are_never_shared_across_namespaces(make_llama: Callable[..., Any]) -> None:
    """A tenant's live prefix is offered to its own namespace only: another tenant with the same prompt evaluates
    it (as with a stream per slot, a tenant never lands on another's state)."""
    from ckpt_plugin.core.request import RequestScope, current_request

    host = make_llama("llama")
    text = " ".join(np.random.default_rng(3).choice(WORDS, 60))
    parallel = ParallelLlama(host, 2, unified=True, load_entrypoints=False)
    counters = parallel.manager.counters

    def as_tenant(namespace: str, prompt: str) -> str:
        token = current_request.set(RequestScope(namespace=namespace))
        try:
            return served(parallel, prompt)
        finally:
            current_request.reset(token)

    try:
        for namespace, prompt in (("a", " one"), ("b", " two"), ("a", " three"), ("b", " four")):
            as_tenant(namespace, text + prompt)
        assert counters.kv_shares == 0, parallel.manager.stats()  # each tenant's next turn from its own slot
        evaluated = counters.prompt_tokens - counters.tokens_reused
        assert evaluated >= 2 * len(host.tokenize(text.encode())), parallel.manager.stats()
    finally:
        parallel.close()
