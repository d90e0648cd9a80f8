"""llama-cpp-python's multimodal chat handler (llava-1-5) on parallel slots' views (``ParallelLlama``), with a real
tiny projector that libmtmd loads: the handler's text and image chunks are evaluated on the slot its request leases
(the image decoded into that slot's sequence, keyed by its content), the completion takes that slot over, and an
image stored by one slot serves a follow-up on any other. Each answer equals the host alone's (the requests run one
after the other here: concurrent ones are in tests/server/test_parallel_vision.py).
"""

from __future__ import annotations

import pathlib
from typing import Any, Callable

import pytest
from llama_cpp.llama_chat_format import Llava15ChatHandler
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

from ckpt_plugin.core.errors import UnsupportedHostError
from ckpt_plugin.core.media import is_media
from ckpt_plugin.hosts.llama_cpp.parallel.parallel_llama import ParallelLlama
from test_multimodal import MAX_TOKENS, reply, user



def vision_llama(make_llama: Callable[..., Any], mmproj: pathlib.Path, kind: str, **kwargs: Any) -> Any:
    handler = Llava15ChatHandler(clip_model_path=str(mmproj), verbose=False)
    return make_llama(kind, chat_handler=handler, **{"n_ctx": 512, **kwargs})


def served(parallel: ParallelLlama, messages: list[dict[str, Any]]) -> str:
    view = parallel.view()
    try:
        return reply(view, messages)
    finally:
        view.close()


def idle(parallel: ParallelLlama) -> bool:
    return not any(parallel.busy(i) for i in range(parallel.n_slots))


@pytest.mark.parametrize("kind", ["gemma3", "hybrid"])
def test_an_image_stored_by_one_slot_serves_a_follow_up_on_another(make_llama: Callable[..., Any],
                                                                   mmproj: pathlib.Path, kind: str) -> None:
    host = vision_llama(make_llama, mmproj, kind)
    parallel = ParallelLlama(vision_llama(make_llama, mmproj, kind), 2, load_entrypoints=False)
    counters = parallel.manager.counters
    try:
        first = [user("what is this?", 1)]
        answer = served(parallel, first)
        assert answer == reply(host, first)
        assert counters.media_chunks == 1 and counters.media_positions > 0
        held = [i for i in range(2) if is_media(parallel.manager.controllers[i].slot.tokens).any()]
        assert len(held) == 1  # the image's positions are recorded under its ids, on the slot that decoded it
        # Both slots go to other conversations (each parks what it held in the cache first).
        for seed in (2, 3):
            served(parallel, [user("what is this?", seed)])
        assert counters.media_chunks == 3
        second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "and the colour?"}]
        reused = counters.tokens_reused_from_cache
        assert served(parallel, second) == reply(host, second)
        assert counters.media_chunks == 3  # restored from the cache into whichever slot it got: not encoded again
        assert counters.tokens_reused_from_cache > reused
        # A text-only request on a view of the same server, and the image again.
        text = [{"role": "user", "content": "tell me a story"}]
        assert served(parallel, text) == reply(host, text)
        assert served(parallel, second) == reply(host, second)
        assert counters.media_chunks == 3 and counters.stood_aside == 0
        assert idle(parallel)
    finally:
        parallel.close()


def test_a_live_slots_image_is_shared_by_another_slot_in_one_pool(make_llama: Callable[..., Any],
                                                                 mmproj: pathlib.Path) -> None:
    """``unified=True`` on plain attention: a request whose prompt starts with what another busy slot holds, image
    included, takes those cells (``llama_memory_seq_cp``) instead of encoding the image again."""
    host = vision_llama(make_llama, mmproj, "llama")
    parallel = ParallelLlama(vision_llama(make_llama, mmproj, "llama", n_ctx=1024), 2, unified=True,
                             load_entrypoints=False)
    counters = parallel.manager.counters
    try:
        messages = [{"role": "system", "content": "be brief"}, user("what is this?", 4)]
        busy = parallel.view()
        stream = busy.create_chat_completion(messages=messages, temperature=0.0, max_tokens=40, stream=True)
        next(stream), next(stream)  # its slot is busy, generating, and holds the image
        assert counters.media_chunks == 1
        other = messages[:1] + [user("what is this? tell me more", 4)]
        assert served(parallel, other) == reply(host, other)
        assert counters.media_chunks == 1 and counters.kv_shares == 1
        busy.close()
        assert idle(parallel)
    finally:
        parallel.close()


def test_a_failed_or_abandoned_handler_releases_its_slot(make_llama: Callable[..., Any],
                                                        mmproj: pathlib.Path) -> None:
    host = vision_llama(make_llama, mmproj, "gemma3")
    parallel = ParallelLlama(vision_llama(make_llama, mmproj, "gemma3", n_ctx=128), 2, load_entrypoints=False)
    try:
        # The handler leases a slot at its first chunk, then finds the prompt longer than a slot's n_ctx.
        long = [user("what is this? " * 40, 5)]
        with pytest.raises(ValueError, match="Prompt exceeds n_ctx"):
            served(parallel, long)
        assert idle(parallel)
        # A stream the handler prepared (its prompt evaluated on a slot) and nobody read: closing the view frees it.
        view = parallel.view()
        stream = view.create_chat_completion(messages=[user("what is this?", 5)], temperature=0.0, max_tokens=4,
                                             stream=True)
        assert not idle(parallel)
        view.close()
        assert idle(parallel)
        assert stream is not None
        short = [user("what is this?", 5)]
        assert served(parallel, short) == reply(host, short)
        assert parallel.manager.counters.media_chunks == 1  # the abandoned stream's image served the next request
    finally:
        parallel.close()


def test_a_prompt_that_cannot_be_keyed_is_refused_not_decoded_into_another_slot(make_llama: Callable[..., Any],
                                                                              mmproj: pathlib.Path) -> None:
    """Prompt lookup decoding would be handed an image's positions as tokens: with one slot the host serves such a
    prompt itself, which parallel slots cannot (the handler decodes into sequence 0, another request's)."""
    llama = vision_llama(make_llama, mmproj, "gemma3", draft_model=LlamaPromptLookupDecoding(num_pred_tokens=2))
    parallel = ParallelLlama(llama, 2, load_entrypoints=False)
    try:
        with pytest.raises(UnsupportedHostError, match="draft model"):
            served(parallel, [user("what is this?", 6)])
        assert idle(parallel) and parallel.manager.counters.media_chunks == 0
        text = [{"role": "user", "content": "tell me a story"}]
        assert served(parallel, text)  # text is served as before
    finally:
        parallel.close()


def test_a_vision_request_whose_client_left_ends_without_a_token_and_frees_its_slot(
        make_llama: Callable[..., Any], mmproj: pathlib.Path) -> None:
    """The handler's chunks are passed over (nothing encoded), its completion ends at once, the slot is free, and
    the next request answers as the host alone."""
    from ckpt_plugin.core.request import RequestScope, current_request

    host = vision_llama(make_llama, mmproj, "gemma3")
    parallel = ParallelLlama(vision_llama(make_llama, mmproj, "gemma3"), 2, load_entrypoints=False)
    try:
        messages = [user("what is this?", 7)]
        scope = RequestScope()
        scope.cancelled.set()
        token = current_request.set(scope)
        view = parallel.view()
        try:
            response = view.create_chat_completion(messages=messages, temperature=0.0, max_tokens=MAX_TOKENS)
        finally:
            view.close()
            current_request.reset(token)
        assert response["choices"][0]["message"]["content"] == ""
        assert response["choices"][0]["finish_reason"] == "length"
        assert parallel.manager.counters.media_chunks == 0 and idle(parallel)
        assert served(parallel, messages) == reply(host, messages)
    finally:
        parallel.close()


def test_a_media_lease_is_released_once_and_never_under_an_evaluation() -> None:
    """A close from another thread while the handler evaluates releases the slot when that evaluation returns, and
    no evaluation starts after it; a lease the generation took over is the generation's to release."""
    import contextlib

    from ckpt_plugin.hosts.llama_cpp.parallel.slot_media import MediaLease

    released: list[int] = []

    def leased(n: int) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.callback(released.append, n)
        return stack

    lease = MediaLease()
    assert not lease.release() and lease.take() is None
    lease.hold(leased(1))
    with lease.evaluating():
        assert lease.release()  # deferred: the evaluation in flight goes on, on its slot
        assert released == [] and lease.held
    assert released == [1] and not lease.held
    with pytest.raises(RuntimeError, match="request ended"):
        with lease.evaluating():
            pass
    lease.hold(leased(2))
    taken = lease.take()
    assert taken is not None and not lease.held and not lease.release()
    taken.close()
    assert released == [1, 2]
