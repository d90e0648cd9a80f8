"""Every write to the context that does not go through the engine, on real llama.cpp contexts: never a wrong answer.

A multimodal chat handler decodes image embeddings straight into the context and leaves ``input_ids`` at those
positions as they were (the ids of an earlier request); here that is simulated with ``llama_decode`` on a batch of
random embeddings, either through ``llama_cpp.llama_decode`` (seen by the engine as it happens) or through the
unwrapped function (as libmtmd's C helper calls it, unseen). Each flow runs on an attached ``Llama`` and on the host
alone, and the answers (greedy) must be equal; where the host alone answers from positions it never evaluated (a
later request matched on stale ids), the attached ``Llama`` must answer as a fresh context does instead.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

import llama_cpp
import numpy as np
import pytest

import ckpt_plugin
from ckpt_plugin.core.errors import OpaqueMemoryError
from ckpt_plugin.hosts.llama_cpp.seam.context import last_logits
from ckpt_plugin.hosts.llama_cpp.attachment.host_cache import host_only_known

KINDS = ["llama", "gemma3"]
ALL_KINDS = ["llama", "gemma3", "mamba", "hybrid"]  # attention, sliding window, recurrent, hybrid
MAX_TOKENS = 8

rng = np.random.default_rng(1)
TEXT0 = rng.integers(5, 200, 20).tolist()  # the system prompt before the image
TEXT1 = rng.integers(5, 200, 6).tolist()  # the question after it
STALE = rng.integers(5, 200, 12).tolist()  # an earlier request's ids where the image will be
N_IMAGE = len(STALE)


def decode_embeddings(llama: Any, seed: int, n: int, seen: bool, logits: bool = True) -> None:
    """Decode ``n`` random embeddings after ``llama.n_tokens`` on sequence 0 and move ``n_tokens`` past them, as
    ``mtmd_helper_eval_chunk_single`` and the handler do (``input_ids`` untouched); ``logits``: with the last
    position's logits."""
    n_embd = llama.n_embd()
    embeddings = np.random.default_rng(seed).standard_normal((n, n_embd)).astype(np.float32)
    batch = llama_cpp.llama_batch_init(n, n_embd, 1)
    decode = llama_cpp.llama_decode if seen else getattr(llama_cpp.llama_decode, "__wrapped__", llama_cpp.llama_decode)
    try:
        start = llama.n_tokens
        ctypes.memmove(batch.embd, embeddings.ctypes.data, embeddings.nbytes)
        for i in range(n):
            batch.pos[i] = start + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = logits and i == n - 1
        batch.n_tokens = n
        assert decode(llama.ctx, batch) == 0
    finally:
        llama_cpp.llama_batch_free(batch)
    llama.n_tokens = start + n


def image_request(llama: Any, seed: int, seen: bool) -> str:
    """What an MTMD chat handler does for one request with one image (llama_chat_format.py, 0.3.36)."""
    llama.reset()
    llama._ctx.kv_cache_clear()
    llama.eval(TEXT0)
    decode_embeddings(llama, seed, N_IMAGE, seen)
    llama.eval(TEXT1)
    return complete(llama, llama.input_ids[: llama.n_tokens].tolist())


def complete(llama: Any, prompt: list[int]) -> str:
    return llama.create_completion(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)["choices"][0]["text"]


TEXT_PROMPT = TEXT0 + STALE + TEXT1


def conversation(llama: Any, seen: bool) -> tuple[str, str, str, str]:
    """A text request, two requests with different images behind its stale ids, the text request again."""
    return (complete(llama, TEXT_PROMPT), image_request(llama, 7, seen), image_request(llama, 8, seen),
            complete(llama, TEXT_PROMPT))


@pytest.mark.parametrize("seen", [True, False], ids=["llama_decode", "unseen-decode"])
@pytest.mark.parametrize("kind", KINDS)
def test_image_requests_answer_as_the_host_alone(make_llama: Callable[..., Any], kind: str, seen: bool) -> None:
    host = conversation(make_llama(kind), seen)
    attached_llama = make_llama(kind)
    manager = ckpt_plugin.attach(attached_llama)
    attached = conversation(attached_llama, seen)
    # The two images get their own answers, each the host's.
    assert host[1] != host[2], "the simulated images must change the answer for this test to mean anything"
    assert attached[1:3] == host[1:3]
    # The host alone answers the repeated text request from the image's state (its stale ids match the prompt);
    # the plugin never matches positions it did not evaluate: the answer a fresh context gives.
    assert attached[3] == attached[0] == host[0]
    assert host[3] == host[2]
    stats = manager.stats()
    assert stats["stood_aside"] == 2
    assert stats["outside_writes_dropped"] >= 1


def fresh_answer(make_llama: Callable[..., Any], kind: str, seed: int) -> tuple[int, str]:
    """A fresh context's first token (the argmax of its logits) and answer after the writes of one image request."""
    llama = make_llama(kind)
    llama.eval(TEXT0)
    decode_embeddings(llama, seed, N_IMAGE, seen=True)
    llama.eval(TEXT1)
    first = int(np.argmax(last_logits(llama)))
    return first, complete(llama, llama.input_ids[: llama.n_tokens].tolist())


@pytest.mark.parametrize("seen", [True, False], ids=["llama_decode", "unseen-decode"])
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_outside_embeddings_answer_as_a_fresh_context_on_every_kind(make_llama: Callable[..., Any], kind: str,
                                                                    seen: bool) -> None:
    """Text, embeddings decoded by host code, more text, then the host's own record completed (stale ids where the
    embeddings are): the first token comes from the logits the context holds, on a memory that cannot drop its last
    position (recurrent, hybrid) too, never from evaluating the stale ids again."""
    fresh = {seed: fresh_answer(make_llama, kind, seed) for seed in (7, 8)}
    host_llama, attached_llama = make_llama(kind), make_llama(kind)
    manager = ckpt_plugin.attach(attached_llama)
    for llama in (host_llama, attached_llama):
        complete(llama, TEXT_PROMPT)  # the stale ids, in the host's record and in the cache
    evaluated = manager.stats()["tokens_evaluated"]
    answers = []
    for seed in (7, 8):
        host = image_request(host_llama, seed, seen)
        attached = image_request(attached_llama, seed, seen)
        first, answer = fresh[seed]
        assert attached == host == answer
        # The first token generated (evaluated for the second) is the argmax of a fresh context's logits.
        assert attached_llama.input_ids[len(TEXT_PROMPT)] == host_llama.input_ids[len(TEXT_PROMPT)] == first
        answers.append(attached)
    assert answers[0] != answers[1]
    stats = manager.stats()
    assert stats["stood_aside"] == 2
    # Each request: its two texts and the answer's tokens; the prompt is never evaluated again.
    assert stats["tokens_evaluated"] - evaluated == 2 * (len(TEXT0) + len(TEXT1) + MAX_TOKENS - 1)
    # The next request is served from what token ids name, as a fresh context serves it.
    assert complete(attached_llama, TEXT_PROMPT) == complete(make_llama(kind), TEXT_PROMPT)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_prompts_that_leave_the_record_after_outside_embeddings(make_llama: Callable[..., Any], kind: str) -> None:
    """The host's record completed in another way than the memory holds it: nothing is evaluated at positions whose
    content the ids do not name."""
    other = [9, 8, 7, 6, 5]

    def after_image(llama: Any, prompt_of: Callable[[list[int]], list[int]], text: bool = True,
                    logits: bool = True) -> str:
        llama.reset()
        llama._ctx.kv_cache_clear()
        llama.eval(TEXT0)
        decode_embeddings(llama, 7, N_IMAGE, seen=True, logits=logits)
        if text:
            llama.eval(TEXT1)
        return complete(llama, prompt_of(llama.input_ids[: llama.n_tokens].tolist()))

    llama = make_llama(kind)
    manager = ckpt_plugin.attach(llama)
    recurrent = kind in ("mamba", "hybrid")
    # Leaving before the embeddings: the record is the truth there, served like any prompt.
    before = TEXT0[:10] + other
    assert after_image(llama, lambda record: record[:10] + other) == complete(make_llama(kind), before)
    # Leaving after them: an attention memory drops what follows and evaluates the rest, as the host alone does; a
    # recurrent one would have to evaluate the stale ids again, and refuses.
    after = lambda record: record[: len(TEXT0) + N_IMAGE + 3] + other  # noqa: E731
    if recurrent:
        with pytest.raises(OpaqueMemoryError):
            after_image(llama, after)
    else:
        assert after_image(llama, after) == after_image(make_llama(kind), after)
    # Ending with the embeddings, whose last position has no logits: nothing to sample from (the host alone aborts
    # the process in llama.cpp's sampler), and the stale id there must not be evaluated.
    with pytest.raises(OpaqueMemoryError):
        after_image(llama, lambda record: record, text=False, logits=False)
    # Ending with them with their logits: sampled from those.
    with_logits = after_image(llama, lambda record: record, text=False)
    fresh = make_llama(kind)
    fresh.eval(TEXT0)
    decode_embeddings(fresh, 7, N_IMAGE, seen=True)
    assert with_logits == complete(fresh, fresh.input_ids[: fresh.n_tokens].tolist())
    # The slot is free and right for the next request.
    assert complete(llama, TEXT_PROMPT) == complete(make_llama(kind), TEXT_PROMPT)
    assert manager.stats()["outside_writes_dropped"] >= 1


def test_a_memory_cleared_and_refilled_to_the_same_length_is_not_trusted(make_llama: Callable[..., Any]) -> None:
    """An image-first request whose image spans exactly the positions the previous request left."""
    llama = make_llama("llama")
    fresh = make_llama("llama")
    manager = ckpt_plugin.attach(llama)
    earlier = STALE + TEXT1
    complete(llama, earlier)
    llama.reset()
    llama._ctx.kv_cache_clear()
    decode_embeddings(llama, 3, N_IMAGE, seen=True)
    llama.eval(TEXT1)
    # The handler completes its own prompt (the stale ids at the image): as the host alone would.
    complete(llama, llama.input_ids[: llama.n_tokens].tolist())
    assert manager.stats()["stood_aside"] == 1
    # The next request is the earlier one again: served from what token ids name, not from the image.
    assert complete(llama, earlier) == complete(fresh, earlier)


def test_clears_resets_rewinds_and_edits(make_llama: Callable[..., Any]) -> None:
    llama = make_llama("gemma3")
    fresh = make_llama("gemma3")
    manager = ckpt_plugin.attach(llama)
    prompt = rng.integers(5, 200, 90).tolist()
    expected = complete(fresh, prompt)
    assert complete(llama, prompt) == expected

    # Llama.reset() only forgets the host's count: the memory is still the prompt's, and reused.
    llama.reset()
    reused = manager.stats()["tokens_reused"]
    assert complete(llama, prompt) == expected
    assert manager.stats()["tokens_reused"] - reused == len(prompt) - 1

    # The context wrapper's clear and llama.cpp's own: everything is evaluated again.
    for clear in (lambda: llama._ctx.kv_cache_clear(),
                  lambda: llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llama.ctx), True)):
        clear()
        evaluated = manager.stats()["tokens_evaluated"]
        assert complete(llama, prompt) == expected
        assert manager.stats()["tokens_evaluated"] - evaluated == len(prompt) + MAX_TOKENS - 1

    # Host code rewinds n_tokens and evaluates something else there: as the host alone does.
    for target in (llama, fresh):
        complete(target, prompt)
        target.n_tokens = 40
        target.eval(TEXT1)
    assert complete(llama, prompt[:40] + TEXT1) == complete(fresh, prompt[:40] + TEXT1)

    # Host code edits input_ids: a new prompt is still matched against what the memory holds.
    complete(llama, prompt)
    llama.input_ids[10:20] = 7
    assert complete(llama, prompt) == expected


def test_embed_on_a_generation_model_changes_nothing(make_llama: Callable[..., Any]) -> None:
    llama = make_llama("llama")
    fresh = make_llama("llama")
    ckpt_plugin.attach(llama)
    prompt = rng.integers(5, 200, 50).tolist()
    complete(llama, prompt)
    with pytest.raises(RuntimeError):
        llama.embed("hello")
    assert complete(llama, prompt + TEXT1) == complete(fresh, prompt + TEXT1)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_third_party_decode_then_generate_answers_as_the_host_alone(make_llama: Callable[..., Any], kind: str) -> None:
    """Guidance-style use: tokens decoded with llama_decode directly, the host's bookkeeping set by hand; the prompt
    continues them, and only its rest is evaluated (a recurrent memory included, which the host alone empties and
    evaluates again: its record is the truth here, so the answers are equal)."""

    def flow(llama: Any) -> str:
        complete(llama, TEXT_PROMPT)
        tokens = TEXT0 + TEXT1
        ids = (llama_cpp.llama_token * len(tokens))(*tokens)
        batch = llama_cpp.llama_batch_get_one(ids, len(tokens))
        llama._ctx.kv_cache_clear()
        assert llama_cpp.llama_decode(llama.ctx, batch) == 0
        llama.input_ids[: len(tokens)] = tokens
        llama.n_tokens = len(tokens)
        return complete(llama, tokens + STALE[:3])

    host = flow(make_llama(kind))
    llama = make_llama(kind)
    manager = ckpt_plugin.attach(llama)
    evaluated = manager.stats()["tokens_evaluated"]
    assert flow(llama) == host
    stats = manager.stats()
    assert stats["stood_aside"] == 1
    # The first request, then the prompt's three tokens after the decoded ones and the answer's.
    assert stats["tokens_evaluated"] - evaluated == len(TEXT_PROMPT) + MAX_TOKENS - 1 + 3 + MAX_TOKENS - 1


def test_a_memory_with_unknown_positions_is_never_saved_cached_or_published(make_llama: Callable[..., Any],
                                                                              tmp_path: Any) -> None:
    from llama_cpp.llama_cache import LlamaRAMCache

    llama = make_llama("llama")
    manager = ckpt_plugin.attach(llama)
    llama.set_cache(LlamaRAMCache(1 << 26))
    image_request(llama, 7, seen=False)
    controller = manager.controllers[0]
    controller.reconcile()
    assert controller.holds_outside_writes
    with pytest.raises(OpaqueMemoryError):
        manager.save_slot(tmp_path / "slot.bin")
    state = llama.save_state()
    assert host_only_known(state) == len(TEXT0)
    entries = len(manager.cache)
    llama.cache[TEXT_PROMPT] = state  # what the host does after a completion: refused quietly
    assert len(manager.cache) == entries
    # The host's own state round-trips as the host's.
    llama.load_state(state)
    controller.reconcile()
    assert controller.holds_outside_writes and controller.slot.n_tokens == len(TEXT0)
