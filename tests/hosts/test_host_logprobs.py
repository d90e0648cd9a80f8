"""Logprobs computed vectorized (``attachment/host_logprobs.py``) equal llama-cpp-python's own, value for value.

The attached ``Llama`` runs the host's completion without logprobs and fills them in; the reference is the host's own
per-token loop, either on an attached ``Llama`` driven the way the attachment drove it before (the same rows, so the
responses must be identical: keys, order, values and their types) or on an unattached ``Llama`` (identical where
llama.cpp computed the same rows, within rounding elsewhere: see ``test_equal_to_an_unattached_host``).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ckpt_plugin
from ckpt_plugin.hosts.llama_cpp.attachment.host_logprobs import completion_with_reads
from ckpt_plugin.hosts.llama_cpp.attachment.logprobs import ROW_BLOCK, stop_sequences, top_indices

KINDS = ["llama", "gemma3", "mamba"]
BOS_ID, EOS_ID = 1, 2
PROMPT = "the cat and the dog went to the house"
LONG_PROMPT = " ".join([PROMPT] * 9)  # more rows than ROW_BLOCK
TOLERANCE = 1e-3


# -- the ordering ----------------------------------------------------------------------------------------------------

def host_order(values: Any, k: int) -> list[int]:
    """What the host lists: ``sorted(zip(logprobs_row, range(n_vocab)), reverse=True)[:k]``."""
    return [i for _, i in sorted(zip(values, range(len(values))), reverse=True)[:k]]


SPECIAL = st.sampled_from([0.0, -0.0, 1.0, -1.0, -np.inf, np.inf, -3.5])
ROWS = hnp.arrays(
    np.float32,
    st.integers(1, 300),
    # Few distinct values make ties common; -inf, inf and both zeros are among them.
    elements=st.one_of(SPECIAL, st.floats(-4, 4, width=32), st.integers(-3, 3).map(float)),
)


@settings(max_examples=400, deadline=None)
@given(values=ROWS, k=st.integers(-5, 320))
def test_top_indices_is_the_hosts_sort(values: np.ndarray, k: int) -> None:
    got = top_indices(values, k).tolist()
    assert got == host_order(values, k)  # np.float32 items, as in a non-streamed response
    assert got == host_order(values.tolist(), k)  # floats, as in a streamed chunk


@settings(max_examples=100, deadline=None)
@given(values=hnp.arrays(np.float32, st.integers(1, 50), elements=st.one_of(SPECIAL, st.just(np.nan))),
       k=st.integers(0, 60))
def test_top_indices_with_nan_is_the_hosts_sort(values: np.ndarray, k: int) -> None:
    assert top_indices(values, k).tolist() == host_order(values.tolist(), k)


def test_top_indices_on_a_large_row_with_ties() -> None:
    rng = np.random.default_rng(3)
    values = rng.integers(-20, 0, 262_144).astype(np.float32)  # Gemma-3's vocabulary size, many ties
    values[rng.integers(0, len(values), 50)] = 0.0
    for k in (0, 1, 5, 20, 100):
        assert top_indices(values, k).tolist() == host_order(values.tolist(), k)


def test_stop_sequences_as_the_host_builds_them() -> None:
    assert stop_sequences(None) == [] and stop_sequences([]) == [] and stop_sequences("é") == ["é".encode()]
    assert stop_sequences(["a", "bc"]) == [b"a", b"bc"]


# -- helpers ---------------------------------------------------------------------------------------------------------

def host_path(llama: Any) -> None:
    """Have an attached ``llama`` compute logprobs with llama-cpp-python's own loop, over the rows the attachment
    keeps: the host's completion is called with the request's own ``logprobs``, after noting what it reads."""
    attachment = llama._ckpt_plugin_attachment

    def completion(*args: Any, **kwargs: Any) -> Any:
        bound = attachment._completion_signature.bind(llama, *args, **kwargs)
        reads = (bound.arguments.get("logprobs") is not None, bool(bound.arguments.get("echo", False)))
        return completion_with_reads(llama, attachment._create_completion(*args, **kwargs), reads,
                                     attachment._note_reads)

    llama._create_completion = completion


def strip(value: Any) -> Any:
    """A response without what differs between any two calls (``id``, ``created``)."""
    if isinstance(value, dict):
        return {k: strip(v) for k, v in value.items() if k not in ("id", "created")}
    if isinstance(value, list):
        return [strip(v) for v in value]
    return value


def assert_identical(got: Any, want: Any, tolerance: float = 0.0, where: str = "") -> None:
    """Equal, with the same types (``np.float32`` is not ``float``) and dict keys in the same order."""
    assert type(got) is type(want), (where, got, want)
    if isinstance(want, dict):
        assert list(got) == list(want), (where, list(got), list(want))
        for key in want:
            assert_identical(got[key], want[key], tolerance, f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), (where, got, want)
        for i, (a, b) in enumerate(zip(got, want)):
            assert_identical(a, b, tolerance, f"{where}[{i}]")
    elif isinstance(want, (float, np.floating)):
        if math.isnan(want):
            assert math.isnan(got), where
        elif tolerance:
            assert abs(got - want) <= tolerance, (where, got, want)
        else:
            assert got == want, (where, got, want)
    else:
        assert got == want, (where, got, want)


def run(llama: Any, request: dict[str, Any]) -> Any:
    """The response (the chunks of a stream), then the name of what the host raised, if it did."""
    out: list[Any] = []
    try:
        response = llama.create_completion(**request)
        if not request.get("stream"):
            return strip(response)
        for chunk in response:
            out.append(strip(chunk))
    except Exception as error:  # the host's own failures (an empty prompt's stream, an echo of a token list)
        out.append(type(error).__name__)
    return out


def forcing(script: list[int]) -> Callable[[Any, Any], Any]:
    """A logits processor that makes sampling pick ``script``'s tokens in turn (the logits rows stay the model's:
    the processor sees the sampler's copy)."""
    start: list[int] = []

    def processor(input_ids: Any, logits: Any) -> Any:
        if not start:
            start.append(len(input_ids))
        step = len(input_ids) - start[0]
        if step >= len(script):
            return logits
        forced = np.full_like(logits, -1e9)
        forced[script[step]] = 0.0
        return forced

    return processor


def byte_tokens(text: str) -> list[int]:
    """The tiny vocabulary's byte-fallback tokens for ``text``'s UTF-8 bytes (after the 3 special tokens)."""
    return [3 + b for b in text.encode("utf-8")]


def requests(llama: Any) -> list[dict[str, Any]]:
    """Every shape of logprobs request: top-k sizes, echo, streaming, stop strings (hit inside a token, across
    tokens, held back and then released at the length cut-off), length cut-offs, BOS handling, multi-byte characters
    held back, an end-of-generation token. A ``script`` is forced through a logits processor (:func:`forcing`)."""
    cat = llama.tokenize(b"cat", add_bos=False)
    words = llama.tokenize(b"the dog went to the house", add_bos=False)
    multibyte = byte_tokens("\u00e9") + cat + byte_tokens("\u20ac") + byte_tokens("\U0001f600") + cat + [EOS_ID]
    shapes: list[dict[str, Any]] = [
        {},
        {"stop": ["e", " th"]},
        {"max_tokens": 1},
        {"prompt": ""},  # the host starts completion_tokens with a BOS (and its stream then fails on a row)
        {"prompt": [BOS_ID, *llama.tokenize(PROMPT.encode(), add_bos=False)]},
        {"prompt": llama.tokenize(PROMPT.encode(), add_bos=False)},  # no BOS: echo pairs each token with the next row
        {"prompt": LONG_PROMPT},
        {"script": multibyte, "max_tokens": 20},
        {"script": multibyte, "max_tokens": 20, "stop": ["\u20ac"]},
        {"script": words + [EOS_ID], "max_tokens": 20, "stop": ["e d"]},
        {"script": words, "max_tokens": len(words), "stop": ["house!", "zz"]},
        {"script": words + [EOS_ID], "max_tokens": 20, "stop": "o t"},
    ]
    out = []
    for logprobs in (0, 1, 2, 5, 20):
        for echo in (False, True):
            for stream in (False, True):
                for shape in shapes:
                    if logprobs in (1, 20) and shape.get("prompt") == LONG_PROMPT:
                        continue
                    out.append({**dict(prompt=PROMPT, max_tokens=8, temperature=0, logprobs=logprobs, echo=echo,
                                       stream=stream), **shape})
    return out


def with_processor(request: dict[str, Any]) -> dict[str, Any]:
    """The request to send: its ``script`` as a fresh logits processor (it counts the steps of one generation)."""
    request = dict(request)
    script = request.pop("script", None)
    return {**request, "logits_processor": [forcing(script)]} if script is not None else request


# -- against the host's own loop, on the same rows -------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_identical_to_the_hosts_loop(make_llama: Any, kind: str) -> None:
    llama = make_llama(kind, logits_all=True)
    reference = make_llama(kind, logits_all=True)
    ckpt_plugin.attach(llama, checkpoint_min_step=32, load_entrypoints=False)
    ckpt_plugin.attach(reference, checkpoint_min_step=32, load_entrypoints=False)
    host_path(reference)
    for request in requests(llama):
        want = run(reference, with_processor(request))
        got = run(llama, with_processor(request))
        assert_identical(got, want, where=repr(request))


def test_identical_to_the_hosts_loop_with_a_draft_model(make_llama: Any) -> None:
    """Speculative batches: the host reads rows of drafted positions it evaluated and then dropped."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    def draft() -> Any:
        return LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=4)

    llama = make_llama("llama", logits_all=True, draft_model=draft())
    reference = make_llama("llama", logits_all=True, draft_model=draft())
    ckpt_plugin.attach(llama, load_entrypoints=False)
    ckpt_plugin.attach(reference, load_entrypoints=False)
    host_path(reference)
    prompt = " ".join(["the cat and the dog"] * 6)
    for echo in (False, True):
        for stream in (False, True):
            request = dict(prompt=prompt, max_tokens=16, temperature=0, logprobs=3, echo=echo, stream=stream)
            assert_identical(run(llama, request), run(reference, request), where=repr(request))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_identical_to_the_hosts_loop(make_llama: Any, stream: bool) -> None:
    llama = make_llama("gemma3", logits_all=True, chat_format="chatml")
    reference = make_llama("gemma3", logits_all=True, chat_format="chatml")
    ckpt_plugin.attach(llama, checkpoint_min_step=32, load_entrypoints=False)
    ckpt_plugin.attach(reference, checkpoint_min_step=32, load_entrypoints=False)
    host_path(reference)
    messages = [{"role": "system", "content": "be brief " * 20}, {"role": "user", "content": "hello there"}]
    for top in (0, 1, 3, 20):
        for extra in ({}, {"stop": ["e"]}, {"max_tokens": 1}):
            request = {**dict(messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=top,
                              stream=stream), **extra}
            got = llama.create_chat_completion(**request)
            want = reference.create_chat_completion(**request)
            got, want = (list(got), list(want)) if stream else (got, want)
            assert_identical(strip(got), strip(want), where=repr(request))


# -- against an unattached host --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_equal_to_an_unattached_host(make_llama: Any, kind: str) -> None:
    """Fresh contexts on both sides. Identical (``==`` with types) where llama.cpp computes the same rows: a prompt of
    one token, and (attention models) an echo, whose rows the plugin computes in the host's batches. Elsewhere the
    plugin has llama.cpp compute fewer logits per batch (``docs/server.md``, logits on demand), which moves the
    first completion row by float rounding: the same response within that."""
    text = PROMPT
    shapes: list[tuple[dict[str, Any], bool]] = [
        ({"prompt": ""}, True),
        ({"prompt": [BOS_ID]}, True),
        ({"prompt": text, "echo": True}, kind != "mamba"),
        ({"prompt": text, "echo": True, "stop": ["e"]}, kind != "mamba"),
        ({"prompt": text}, False),
        ({"prompt": text, "stop": "cat"}, False),
    ]
    for shape, exact in shapes:
        for stream in (False, True):
            for logprobs in (0, 3):
                request = {**dict(max_tokens=8, temperature=0, logprobs=logprobs, stream=stream), **shape}
                llama = make_llama(kind, logits_all=True)
                ckpt_plugin.attach(llama, load_entrypoints=False)
                got = run(llama, request)
                want = run(make_llama(kind, logits_all=True), request)
                assert_identical(got, want, 0.0 if exact else TOLERANCE, where=repr(request))


def test_chat_equal_to_an_unattached_host(make_llama: Any) -> None:
    for stream in (False, True):
        llama = make_llama("gemma3", logits_all=True, chat_format="chatml")
        reference = make_llama("gemma3", logits_all=True, chat_format="chatml")
        ckpt_plugin.attach(llama, load_entrypoints=False)
        request = dict(messages=[{"role": "user", "content": "hello there"}], max_tokens=8, temperature=0,
                       logprobs=True, top_logprobs=3, stream=stream)
        got, want = llama.create_chat_completion(**request), reference.create_chat_completion(**request)
        got, want = (list(got), list(want)) if stream else (got, want)
        assert_identical(strip(got), strip(want), TOLERANCE)


# -- the host's slow path is not run ---------------------------------------------------------------------------------

def test_no_vocabulary_sort_and_only_the_rows_read(make_llama: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's loop sorts the vocabulary per token and converts its whole ``scores`` array; the plugin does
    neither (a spy on the host module's ``sorted`` and on ``Llama.logits_to_logprobs``)."""
    import llama_cpp.llama
    from llama_cpp import Llama

    sorts: list[int] = []
    converted: list[tuple[int, ...]] = []
    real = Llama.logits_to_logprobs

    def sorted_spy(iterable: Any, **kwargs: Any) -> list[Any]:
        items = sorted(iterable, **kwargs)
        sorts.append(len(items))
        return items

    def logits_to_logprobs_spy(logits: Any, axis: int = -1) -> Any:
        converted.append(np.shape(logits))
        return real(logits, axis)

    monkeypatch.setattr(llama_cpp.llama, "sorted", sorted_spy, raising=False)
    monkeypatch.setattr(Llama, "logits_to_logprobs", staticmethod(logits_to_logprobs_spy))
    llama = make_llama("llama", logits_all=True)
    ckpt_plugin.attach(llama, load_entrypoints=False)
    response = llama.create_completion(LONG_PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=5)
    n_entries = len(response["choices"][0]["logprobs"]["tokens"])
    assert n_entries > ROW_BLOCK
    assert sum(shape[0] for shape in converted) == n_entries  # no BOS in the entries: one row each
    assert max(shape[0] for shape in converted) <= ROW_BLOCK
    chunks = list(llama.create_completion(PROMPT, max_tokens=6, temperature=0, logprobs=5, stream=True))
    assert sum(1 for c in chunks if c["choices"][0]["logprobs"]) == 6
    assert sorts == []
    # the spy sees the host's own loop (the reference path)
    host_path(llama)
    llama.create_completion(PROMPT, max_tokens=2, temperature=0, logprobs=5)
    assert sorts and max(sorts) == llama.n_vocab()
