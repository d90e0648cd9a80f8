"""Parallel slots over one ``Llama``: concurrent completions through llama-cpp-python's own code, each equal to the
same request on a plain ``Llama``, with the tokens of the busy slots decoded in shared batches."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import llama_cpp
import numpy as np
import pytest

from ckpt_plugin.hosts.llama_cpp.parallel.parallel_llama import ParallelLlama
from ckpt_plugin.hosts.llama_cpp.parallel.slot_choice import IdleSlot, choose_slot
from ckpt_plugin.testing.waiting import wait_until

KINDS = ["llama", "gemma3", "mamba", "hybrid"]


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa"]
    system = " ".join(rng.choice(words, 40))
    return [system + " " + " ".join(rng.choice(words, int(rng.integers(3, 30)))) for _ in range(n)]


def complete(llama: Any, prompt: str, **kwargs: Any) -> dict:
    return llama.create_completion(prompt, **{"max_tokens": 12, "temperature": 0.0, **kwargs})


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


def test_views_sample_a_row_as_the_host_chain_does(make_llama: Callable[..., Any]) -> None:
    """A view runs the request's logits processors on the row and picks a greedy chain's token without filling the
    vocabulary-sized candidates; every sampling setting still answers as the host's own chain on a plain ``Llama``,
    NaN logits included (llama.cpp's greedy sampler never picks one)."""
    from llama_cpp import LlamaGrammar, LogitsProcessorList

    plain = make_llama("llama")
    parallel = ParallelLlama(make_llama("llama"), 2, load_entrypoints=False)

    def nan_first(input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        scores = scores.copy()
        scores[0] = np.nan
        return scores

    def boost_last_input(input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        scores[int(input_ids[-1]) % len(scores)] += 3.0  # in place, as processors may
        return scores

    greedy = {"repeat_penalty": 1.0}
    settings: list[dict[str, Any]] = [
        greedy,
        {**greedy, "logit_bias": {5: 100.0, 7: -100.0}},
        {**greedy, "logits_processor": LogitsProcessorList([boost_last_input])},
        {**greedy, "logits_processor": LogitsProcessorList([nan_first])},
        {"repeat_penalty": 1.3, "logit_bias": {5: 2.0}},
        {**greedy, "grammar": LlamaGrammar.from_string('root ::= ("alpha" | "beta" | " ")+', verbose=False)},
        {**greedy, "temperature": 0.9, "seed": 7},
    ]
    try:
        text = prompts(1, seed=3)[0]
        for index, setting in enumerate(settings):
            kwargs = {"temperature": 0.0, **setting}
            expected = complete(plain, text, **kwargs)["choices"][0]["text"]
            got = complete(parallel.view(), text, **kwargs)["choices"][0]["text"]
            assert got == expected, setting
            if index < 3:
                # Greedy chains chose from the row: no slot has filled a candidates array yet.
                assert all(backend._candidates is None for backend in parallel.backends), setting
    finally:
        parallel.close()


def test_a_slot_cuts_past_its_end_and_reads_its_end_without_waiting_for_a_step(make_llama: Callable[..., Any]) -> None:
    """Between two tokens a slot asks where its memory ends and cuts it there (the host's ``eval``): answered from
    the slot's own bookkeeping, not by a call on the context, which would wait for the other slots' step in flight
    (here: the context lock held by another thread)."""
    plain = make_llama("llama")
    parallel = ParallelLlama(make_llama("llama"), 2, load_entrypoints=False)
    try:
        text = prompts(1, seed=5)[0]
        assert complete(parallel.view(), text)["choices"][0]["text"] == complete(plain, text)["choices"][0]["text"]
        backend = next(b for b in parallel.backends if b.end_bound)
        end = backend.end_bound
        truth = backend.pos_max()
        with parallel.context.lock:  # the step in flight, as far as the slot can tell
            answers: list[Any] = []
            asker = threading.Thread(target=lambda: answers.extend([backend.pos_max(), backend.truncate(end)]))
            asker.start()
            asker.join(5)
            assert not asker.is_alive(), "the slot waited for the context"
        assert answers == [truth, True] and truth == end - 1
        # A cut into the sequence does call llama.cpp, and the bookkeeping follows it.
        assert backend.truncate(end - 3)
        assert backend.end_bound == end - 3 and backend.pos_max() == end - 4
        with parallel.context.lock:
            assert int(llama_cpp.llama_memory_seq_pos_max(parallel.context.memory, backend.seq_id)) == end - 4
    finally:
        parallel.close()


def test_a_callback_at_the_next_step_runs_before_that_steps_decode(make_llama: Callable[..., Any]) -> None:
    from ckpt_plugin.hosts.llama_cpp.parallel.submissions import at_next_step

    parallel = ParallelLlama(make_llama("llama"), 2, load_entrypoints=False)
    try:
        scheduler = parallel.scheduler
        seen: list[int] = []
        at_next_step(lambda: seen.append(scheduler.steps))
        at_next_step(lambda: 1 / 0)  # logged, and the step goes on
        before = scheduler.steps
        tokens = np.array([5, 6, 7, 8], dtype=np.int32)
        rows = scheduler.decode(0, tokens, 0, 3)
        assert seen == [before] and scheduler.steps == before + 1 and rows.shape[0] == 1
        scheduler.decode(0, tokens[:1] + 1, 4, 0)  # nothing registered: nothing runs
        assert seen == [before]
    finally:
        parallel.close()


def test_a_callback_registered_while_a_step_decodes_runs_at_once(make_llama: Callable[..., Any]) -> None:
    """A chunk made while another step computes is sent then, not after that step (a prompt chunk's step can be
    long): the wake-up is postponed only between two steps."""
    from ckpt_plugin.hosts.llama_cpp.parallel import submissions as scheduling

    parallel = ParallelLlama(make_llama("llama"), 2, load_entrypoints=False)
    try:
        ran: list[str] = []
        scheduling._decoding.add(id(parallel.scheduler))  # as during llama_decode
        try:
            scheduling.at_next_step(lambda: ran.append("now"))
        finally:
            scheduling._decoding.discard(id(parallel.scheduler))
        assert ran == ["now"]
        scheduling.at_next_step(lambda: ran.append("at the step"))
        assert ran == ["now"]
        parallel.scheduler.decode(0, np.array([5, 6], dtype=np.int32), 0, 1)
        assert ran == ["now", "at the step"]
    finally:
        parallel.close()


def test_a_slot_holding_the_context_for_its_prepare_gets_its_prompt_into_the_next_step(
    make_llama: Callable[..., Any]
) -> None:
    """A slot changing hands holds its slot and the context from before its prepare until its prompt is queued: no
    step starts meanwhile, and the step that was waiting carries the prompt with what the other slots submitted."""
    parallel = ParallelLlama(make_llama("llama"), 2, load_entrypoints=False)
    scheduler = parallel.scheduler
    try:
        other_rows: list[np.ndarray] = []
        with scheduler.held_until_submitted(parallel.manager.controllers[0].lock):
            other = threading.Thread(
                target=lambda: other_rows.append(scheduler.decode(1, np.array([5, 6, 7], dtype=np.int32), 0, 2)))
            other.start()
            # the other slot's tokens wait: the context is held
            wait_until(lambda: scheduler._pending, timeout=60, interval=0.005)
            assert scheduler.steps == 0
            rows = scheduler.decode(0, np.array([8, 9], dtype=np.int32), 0, 1)  # queued, then the hold is let go
        other.join(10)
        assert scheduler.steps == 1 and scheduler.shared_steps == 1
        assert len(rows) == 1 and len(other_rows[0]) == 1
        # Nothing holds the context afterwards.
        for lock in (parallel.context.lock, parallel.manager.controllers[0].lock):
            free = threading.Thread(target=lambda lock=lock: lock.acquire() and lock.release())
            free.start()
            free.join(5)
            assert not free.is_alive()
    finally:
        parallel.close()


def test_a_hold_takes_the_slots_lock_before_the_context(make_llama: Callable[..., Any]) -> None:
    """The order of every other path (a slot file action holds its slot's lock, then calls on the context): a
    prepare waiting for a slot someone else holds has not taken the context, so the holder can still use it."""
    parallel = ParallelLlama(make_llama("llama"), 2, load_entrypoints=False)
    scheduler, slot_lock = parallel.scheduler, parallel.manager.controllers[0].lock
    try:
        entered = threading.Event()
        asking = threading.Event()

        class Watched:
            """The slot's lock, telling when the hold asks for it (it then blocks: the test's thread holds it)."""

            def acquire(self, *args: Any) -> bool:
                asking.set()
                return slot_lock.acquire(*args)

            def release(self) -> None:
                slot_lock.release()

        def prepare() -> None:
            with scheduler.held_until_submitted(Watched()):  # type: ignore[arg-type]
                entered.set()

        with slot_lock:  # a slot file action on slot 0
            waiting = threading.Thread(target=prepare)
            waiting.start()
            assert asking.wait(60)  # the hold waits for the slot's lock now (whatever it took before)
            assert not entered.is_set()
            assert parallel.context.lock.acquire(timeout=5)  # the action's call on the context
            parallel.context.lock.release()
        waiting.join(10)
        assert entered.is_set()
    finally:
        parallel.close()
