"""Sampling with a grammar or ``ignore_eos`` on attached ``Llama`` objects and parallel slot views: a grammar that
matches nothing where the generation goes ends it with ``GrammarDeadEnd`` (llama.cpp alone aborts the process), and
every answer that does not reach a dead end is the host's own, token for token (greedy and seeded sampling)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import llama_cpp
import numpy as np
import pytest

import ckpt_plugin
from ckpt_plugin.core.request import RequestScope, current_request
from ckpt_plugin.hosts.llama_cpp.seam import compat as host
from ckpt_plugin.hosts.llama_cpp.attachment.guarded_sampling import end_of_generation_ids
from ckpt_plugin.hosts.llama_cpp.parallel.parallel_llama import ParallelLlama

KINDS = ["llama", "gemma3", "mamba", "hybrid"]
DEAD_END = 'root ::= "ab ab ab ab" [z-a]'  # an inverted range: nothing matches after the literal
LIVE = 'root ::= "ab" [a-c]+ ("." | "!")'


def grammar(text: str) -> llama_cpp.LlamaGrammar:
    return llama_cpp.LlamaGrammar.from_string(text, verbose=False)


def complete(llama: Any, prompt: str, **kwargs: Any) -> dict:
    return llama.create_completion(prompt, **{"max_tokens": 16, "temperature": 0.0, **kwargs})


def text_of(llama: Any, prompt: str, **kwargs: Any) -> str:
    return complete(llama, prompt, **kwargs)["choices"][0]["text"]


def test_llama_cpp_alone_aborts_on_the_dead_end(tiny_model: Callable[[str], Any]) -> None:
    """What the guard prevents: the host alone dies on this grammar (a C++ exception through ctypes)."""
    script = textwrap.dedent(f"""
        import llama_cpp
        llama = llama_cpp.Llama({str(tiny_model("llama"))!r}, n_ctx=256, verbose=False)
        g = llama_cpp.LlamaGrammar.from_string({DEAD_END!r}, verbose=False)
        llama.create_completion("hello", max_tokens=32, grammar=g, temperature=0)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={"GGML_NO_BACKTRACE": "1", "PATH": ""})
    assert done.returncode != 0
    assert "Unexpected empty grammar stack" in done.stderr


@pytest.mark.parametrize("kind", KINDS)
def test_a_dead_end_ends_the_generation_and_the_next_request_answers_as_the_host(make_llama: Callable[..., Any],
                                                                                 kind: str) -> None:
    plain = make_llama(kind)
    llama = make_llama(kind)
    ckpt_plugin.attach(llama)
    with pytest.raises(ckpt_plugin.GrammarDeadEnd) as raised:
        complete(llama, "hello there", max_tokens=64, grammar=grammar(DEAD_END))
    assert raised.value.generated >= 4  # the literal was generated first: the dead end lies beyond it
    for temperature in (0.0, 0.8):
        for rule in (LIVE, 'root ::= [a-e]+ " " [f-k]+'):
            expected = text_of(plain, "hello there", grammar=grammar(rule), temperature=temperature, seed=7)
            assert text_of(llama, "hello there", grammar=grammar(rule), temperature=temperature, seed=7) == expected
    assert text_of(llama, "hello again") == text_of(plain, "hello again")


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_ignore_eos_runs_to_max_tokens(make_llama: Callable[..., Any], kind: str) -> None:
    llama = make_llama(kind)
    ckpt_plugin.attach(llama)
    eos = int(end_of_generation_ids(host.model_wrapper(llama))[0])
    assert eos == llama.token_eos()
    forced = {"logit_bias": {eos: 100.0}}  # the host's own logit bias: the end of generation comes first
    assert complete(llama, "hello", max_tokens=12, **forced)["usage"]["completion_tokens"] == 0
    scope = RequestScope(ignore_eos=True)
    token = current_request.set(scope)
    try:
        reply = complete(llama, "hello", max_tokens=12, **forced)
    finally:
        current_request.reset(token)
    assert reply["usage"]["completion_tokens"] == 12
    assert reply["choices"][0]["finish_reason"] == "length"
    # Without the request's word the end of generation is sampled again.
    assert complete(llama, "hello", max_tokens=12, **forced)["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_parallel_slots_end_a_dead_end_and_keep_serving_the_others(make_llama: Callable[..., Any],
                                                                   kind: str) -> None:
    plain = make_llama(kind)
    parallel = ParallelLlama(make_llama(kind), 3, load_entrypoints=False)
    prompts = [f"prompt number {i} " + "word " * i for i in range(6)]
    expected = [text_of(plain, p, grammar=grammar(LIVE)) for p in prompts]

    def run(index: int) -> str | None:
        view = parallel.view()
        try:
            if index % 2:
                with pytest.raises(ckpt_plugin.GrammarDeadEnd):
                    complete(view, prompts[index], max_tokens=64, grammar=grammar(DEAD_END))
                return None
            return text_of(view, prompts[index], grammar=grammar(LIVE))
        finally:
            view.close()

    try:
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(run, range(6)))
        assert [g for g in got if g is not None] == expected[::2]
        assert [text_of(parallel.view(), p, grammar=grammar(LIVE)) for p in prompts] == expected
    finally:
        parallel.close()


def test_ignore_eos_still_ends_where_the_grammar_is_complete(make_llama: Callable[..., Any]) -> None:
    llama = make_llama("llama")
    ckpt_plugin.attach(llama)
    token = current_request.set(RequestScope(ignore_eos=True))
    try:
        reply = complete(llama, "hello", max_tokens=12, grammar=grammar('root ::= "ab"'))
        free = complete(llama, "hello", max_tokens=12, grammar=grammar('root ::= [a-c]+'))
    finally:
        current_request.reset(token)
    # Only the end of generation can follow "ab": it is sampled, though the request leaves it out elsewhere.
    assert reply["choices"][0]["text"] == "ab" and reply["choices"][0]["finish_reason"] == "stop"
    assert free["usage"]["completion_tokens"] == 12 and free["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("settings", [(64, 1.1, 0.0, 0.0), (8, 1.3, 0.2, 0.1), (1, 0.9, 0.0, 0.5)])
def test_window_penalties_equal_llama_cpps_sampler(settings: tuple[int, float, float, float]) -> None:
    """The penalties applied in numpy change exactly the logits llama.cpp's penalties sampler changes, to the same
    values, over a window that fills and slides."""
    import ctypes

    import llama_cpp
    from llama_cpp._internals import LlamaSampler, LlamaTokenDataArray

    from ckpt_plugin.hosts.llama_cpp.attachment.guarded_sampling import WindowPenalties, fill_candidates

    n_vocab, (last_n, repeat, frequency, presence) = 500, settings
    ours = WindowPenalties(last_n, repeat, frequency, presence)
    theirs = LlamaSampler()
    theirs.add_penalties(n_vocab, last_n, repeat, frequency, presence)
    rng = np.random.default_rng(3)
    candidates = LlamaTokenDataArray(n_vocab=n_vocab)
    for step in range(40):
        row = (rng.standard_normal(n_vocab) * 4).astype(np.float32)
        expected_array = candidates
        fill_candidates(expected_array, row)
        array = expected_array.candidates
        array.data = expected_array.candidates_data.ctypes.data_as(llama_cpp.llama_token_data_p)
        llama_cpp.llama_sampler_apply(theirs.sampler, ctypes.byref(array))
        expected = np.array(expected_array.candidates_data.logit, copy=True)
        got = row.copy()
        ours.apply(got)
        assert np.array_equal(got, expected), step
        token = int(rng.integers(0, 12))  # few distinct tokens: counts above one, tokens leaving the window
        theirs.accept(token)
        ours.accept(token)
    assert not WindowPenalties.needed(64, 1.0, 0.0, 0.0) and not WindowPenalties.needed(0, 1.1, 0.0, 0.0)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_penalized_replies_equal_the_hosts_on_one_slot_and_parallel_slots(make_llama: Callable[..., Any],
                                                                          kind: str) -> None:
    """Repetition penalties applied by the window instead of llama.cpp's sampler give the host's own replies, greedy
    and sampled with a seed, with and without a grammar, on an attached ``Llama`` and on parallel slots."""
    requests = [dict(repeat_penalty=1.3, frequency_penalty=0.2, max_tokens=40),
                dict(repeat_penalty=1.1, temperature=0.8, seed=7, max_tokens=40),
                dict(repeat_penalty=1.5, presence_penalty=0.4, grammar=grammar(LIVE), max_tokens=24)]
    plain = make_llama(kind)
    want = [text_of(plain, "the the the", **request) for request in requests]
    attached = make_llama(kind)
    ckpt_plugin.attach(attached)
    assert [text_of(attached, "the the the", **request) for request in requests] == want
    parallel = ParallelLlama(make_llama(kind), 2, load_entrypoints=False)
    try:
        assert [text_of(parallel.view(), "the the the", **request) for request in requests] == want
    finally:
        parallel.close()
