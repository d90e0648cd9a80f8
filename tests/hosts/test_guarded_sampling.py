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
import pytest

import ckpt_plugin
from ckpt_plugin.core.request import RequestScope, current_request
from ckpt_plugin.hosts.llama_cpp import compat as host
from ckpt_plugin.hosts.llama_cpp.guarded_sampling import end_of_generation_ids
from ckpt_plugin.hosts.llama_cpp.parallel import ParallelLlama

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
