"""Parallel slots over one ``Llama``: concurrent completions through llama-cpp-python's own code, each equal to the
same request on a plain ``Llama``, with the tokens of the busy slots decoded in shared batches."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import pytest

from ckpt_plugin.hosts.llama_cpp.parallel import ParallelLlama
from ckpt_plugin.slot_choice import IdleSlot, choose_slot

KINDS = ["llama", "gemma3", "mamba", "hybrid"]


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa"]
    system = " ".join(rng.choice(words, 40))
    return [system + " " + " ".join(rng.choice(words, int(rng.integers(3, 30)))) for _ in range(n)]


def complete(llama: Any, prompt: str, **kwargs: Any) -> dict:
    return llama.create_completion(prompt, max_tokens=12, temperature=0.0, **kwargs)


@pytest.mark.parametrize("kind", KINDS)
def test_concurrent_completions_equal_a_plain_llama(make_llama: Callable[..., Any], kind: str) -> None:
    plain = make_llama(kind)
    host = make_llama(kind)
    parallel = ParallelLlama(host, 3, load_entrypoints=False)
    try:
        texts = prompts(6)
        expected = [complete(plain, text)["choices"][0]["text"] for text in texts]
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda text: complete(parallel.view(), text)["choices"][0]["text"], texts))
        assert got == expected
        # Generated tokens of several slots shared decodes (not only prompt chunks).
        assert parallel.scheduler.shared_steps >= 12, vars(parallel.scheduler)
        print("SCHED", parallel.scheduler.steps, parallel.scheduler.shared_steps, parallel.scheduler.batched_tokens)
        # A second round reuses what the slots and the cache hold: fewer tokens evaluated than the prompts.
        before = parallel.manager.counters.tokens_evaluated
        with ThreadPoolExecutor(6) as pool:
            again = list(pool.map(lambda text: complete(parallel.view(), text)["choices"][0]["text"], texts))
        assert again == expected
        reused = parallel.manager.counters.tokens_reused
        assert reused > 0, parallel.manager.stats()
        assert parallel.manager.counters.tokens_evaluated - before < sum(len(plain.tokenize(t.encode())) for t in texts)
    finally:
        parallel.close()


def test_choose_slot_prefers_the_longest_prefix_of_the_same_namespace_then_lru() -> None:
    prompt = np.arange(10, dtype=np.int32)
    idle = [
        IdleSlot(0, "a", np.arange(4, dtype=np.int32), last_used=5),
        IdleSlot(1, "b", np.arange(9, dtype=np.int32), last_used=1),  # longer, but another tenant's
        IdleSlot(2, "a", np.arange(6, dtype=np.int32), last_used=9),
        IdleSlot(3, "a", np.zeros(0, dtype=np.int32), last_used=0),
    ]
    assert choose_slot(prompt, "a", idle) == 2
    assert choose_slot(prompt, "b", idle) == 1
    assert choose_slot(prompt + 100, "a", idle) == 3  # no shared prefix: least recently used
    with pytest.raises(ValueError):
        choose_slot(prompt, "a", [])


def test_closing_a_view_ends_the_stream_it_left_open(make_llama: Callable[..., Any]) -> None:
    """A client that leaves mid-stream leaves its generation suspended; the server closes the request's view, which
    frees the slot at once, while something (a reference cycle, here the test) still holds the generator."""
    host = make_llama("llama")
    parallel = ParallelLlama(host, 2, load_entrypoints=False)
    try:
        text = prompts(1)[0]
        view = parallel.view()
        stream = view.create_completion(text, max_tokens=40, temperature=0.0, stream=True)
        next(stream), next(stream)
        assert [parallel.busy(i) for i in range(2)].count(True) == 1
        view.close()
        assert not any(parallel.busy(i) for i in range(2))
        assert parallel.scheduler._generating == {}  # no step waits for it any longer
        # The slot serves the next request, which reuses the prefix the abandoned one evaluated.
        plain = make_llama("llama")
        assert complete(parallel.view(), text)["choices"][0]["text"] == complete(plain, text)["choices"][0]["text"]
        assert stream is not None
    finally:
        parallel.close()


def test_every_slot_holds_a_whole_context_in_a_stream_of_its_own(make_llama: Callable[..., Any]) -> None:
    """Each slot has a KV stream of ``n_ctx`` cells: two concurrent prompts of nearly ``n_ctx`` tokens fit at once,
    and each answers as on a plain ``Llama`` of that ``n_ctx``."""
    plain = make_llama("llama", n_ctx=512)
    parallel = ParallelLlama(make_llama("llama", n_ctx=512), 2, load_entrypoints=False)
    try:
        context = parallel.context
        assert not context.unified and context.seq_n_ctx == 512 and context.n_ctx == 1024
        words = ["alpha", "beta", "gamma", "delta", "eps", "zeta"]
        long_prompts = [" ".join(words[(i + k) % 6] for i in range(88)) for k in range(2)]
        assert all(400 < len(plain.tokenize(p.encode())) < 512 - 12 for p in long_prompts)
        expected = [complete(plain, p)["choices"][0]["text"] for p in long_prompts]
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda p: complete(parallel.view(), p)["choices"][0]["text"], long_prompts))
        assert got == expected
    finally:
        parallel.close()
