"""llama-cpp-python's real multimodal chat handler on an attached ``Llama``, with a real (tiny, random-weight)
vision projector that libmtmd loads: the same answers as the host alone, images keyed by content, and reused.

The host's handler clears the memory and encodes every image of the conversation again on every request; with the
plugin, an image already held by the memory, a checkpoint, the cache or a slot file is not encoded again. Each image
encoding is counted where the handler calls libmtmd (``mtmd_helper_eval_chunk_single``).
"""

from __future__ import annotations

import pathlib
from typing import Any, Callable

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llama_cpp.llama_chat_format import Llava15ChatHandler

import ckpt_plugin
from ckpt_plugin.hosts.llama_cpp.attachment.multimodal import MtmdRelay
from ckpt_plugin.testing.tiny_models import image_data_uri, tiny_png, write_tiny_mmproj

from support.servers import model_args, run_server

KINDS = ["llama", "gemma3", "hybrid"]
MAX_TOKENS = 6


class CountingMtmd:
    """libmtmd's module with its media-chunk evaluations counted."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self.media_chunks = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def mtmd_helper_eval_chunk_single(self, *args: Any) -> int:
        self.media_chunks += 1
        return int(self._module.mtmd_helper_eval_chunk_single(*args))


def vision(make_llama: Callable[..., Any], mmproj: pathlib.Path, kind: str, attached: bool) -> tuple[Any, CountingMtmd]:
    handler = Llava15ChatHandler(clip_model_path=str(mmproj), verbose=False)
    counting = CountingMtmd(handler._mtmd_cpp)
    handler._mtmd_cpp = counting
    llama = make_llama(kind, chat_handler=handler, n_ctx=512)
    if attached:
        ckpt_plugin.attach(llama)
        assert isinstance(handler._mtmd_cpp, MtmdRelay)
    return llama, counting


def user(text: str, *image_seeds: int) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": image_data_uri(tiny_png(seed))}}
                                     for seed in image_seeds]
    content.append({"type": "text", "text": text})
    return {"role": "user", "content": content}


def reply(llama: Any, messages: list[dict[str, Any]]) -> str:
    response = llama.create_chat_completion(messages=messages, temperature=0.0, repeat_penalty=1.0,
                                            max_tokens=MAX_TOKENS)
    return response["choices"][0]["message"]["content"] or ""


def session(llama: Any) -> list[str]:
    """A vision chat over two turns, the same question about another image, the first conversation again, a
    text-only request, and two images in one message."""
    answers: list[str] = []
    first = [user("what is this?", 1)]
    answers.append(reply(llama, first))
    second = first + [{"role": "assistant", "content": answers[-1]}, {"role": "user", "content": "and the colour?"}]
    answers.append(reply(llama, second))
    answers.append(reply(llama, [user("what is this?", 2)]))
    answers.append(reply(llama, second))
    answers.append(reply(llama, [{"role": "user", "content": "what is this?"}]))
    answers.append(reply(llama, [user("compare them", 1, 2)]))
    return answers


@pytest.mark.parametrize("kind", KINDS)
def test_answers_equal_the_host_alone_and_images_are_encoded_once(make_llama: Callable[..., Any],
                                                                  mmproj: pathlib.Path, kind: str) -> None:
    host, host_count = vision(make_llama, mmproj, kind, attached=False)
    expected = session(host)
    attached, count = vision(make_llama, mmproj, kind, attached=True)
    assert session(attached) == expected
    if kind != "llama":  # the tiny llama's greedy answers do not depend on these images (its logits do)
        assert expected[0] != expected[2], "the two images must get different answers for the test to tell them apart"
    # The host encodes every image of every request: 1, 1, 1, 1, 0, 2.
    assert host_count.media_chunks == 6
    # With the plugin: image 1 once (turn 2 and the first conversation again reuse it, from the memory and from the
    # cache), image 2 once for its own request and once more after image 1 in the last one (another place, another
    # state): the ideal.
    assert count.media_chunks == 3
    stats = ckpt_plugin.manager_of(attached).stats()
    assert stats["stood_aside"] == 0


def test_turn_two_evaluates_only_the_new_text(make_llama: Callable[..., Any], mmproj: pathlib.Path) -> None:
    llama, count = vision(make_llama, mmproj, "gemma3", attached=True)
    manager = ckpt_plugin.manager_of(llama)
    first = [user("what is this?", 3)]
    answer = reply(llama, first)
    assert count.media_chunks == 1
    evaluated = manager.stats()["tokens_evaluated"]
    second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "and now?"}]
    reply(llama, second)
    assert count.media_chunks == 1
    text_only = llama.tokenize(b"\nUSER: and now?\nASSISTANT: ", add_bos=False)
    assert manager.stats()["tokens_evaluated"] - evaluated <= len(text_only) + len(llama.tokenize(
        answer.encode(), add_bos=False)) + MAX_TOKENS + 2


def test_an_image_survives_a_slot_file(make_llama: Callable[..., Any], mmproj: pathlib.Path,
                                       tmp_path: pathlib.Path) -> None:
    host, _ = vision(make_llama, mmproj, "hybrid", attached=False)
    llama, count = vision(make_llama, mmproj, "hybrid", attached=True)
    manager = ckpt_plugin.manager_of(llama)
    first = [user("what is this?", 4)]
    answer = reply(llama, first)
    assert answer == reply(host, first)
    manager.save_slot(tmp_path / "slot.bin")
    manager.clear_cache()
    reply(llama, [{"role": "user", "content": "something else entirely"}])
    manager.restore_slot(tmp_path / "slot.bin")
    second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "and now?"}]
    assert reply(llama, second) == reply(host, second)
    assert count.media_chunks == 1


def test_vision_chat_through_ckpt_serve(tiny_model: Any, mmproj: pathlib.Path) -> None:
    """Two tenants on one slot: an image-first request between two turns of another tenant, concurrent image
    requests, a stream whose client leaves; each answer equal to llama_cpp.server's alone."""
    import concurrent.futures

    args = model_args(tiny_model("gemma3"), n_ctx=512) + ["--chat_format", "llava-1-5",
                                                          "--clip_model_path", str(mmproj)]

    def ask(server: Any, messages: list[dict[str, Any]], key: str = "a") -> str:
        response = server.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                               json={"messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS,
                                     "repeat_penalty": 1.0})
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["message"]["content"] or "")

    text = [{"role": "user", "content": "tell me a story"}]
    image_first = [user("", 5)]
    requests = [text, image_first, text, [user("what is this?", 6)], [user("what is this?", 7)]]
    with run_server(args, plain=True) as plain:
        expected = [ask(plain, messages) for messages in requests]
    with run_server(args + ["--namespaces", "api_key"]) as server:
        assert ask(server, text, "a") == expected[0]
        assert ask(server, image_first, "b") == expected[1]
        assert ask(server, text, "a") == expected[2]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda m: ask(server, m, "c"), requests[3:] + [text]))
        assert answers == expected[3:] + [expected[0]]
        # A stream whose client leaves after its first chunk; the next request still answers as the host does.
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers={"Authorization": "Bearer d"},
                          json={"messages": requests[3], "stream": True, "max_tokens": 64}, timeout=60) as stream:
            for _ in stream.iter_lines():
                break
        assert ask(server, requests[4], "d") == expected[4]
        assert server.metric("stood_aside") == 0


@pytest.mark.gemma
def test_gemma_vision_chat_answers_as_the_host_alone(gemma_path: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """Gemma-3-270M with a random projector of its width (16 positions an image): two images, two turns.

    Turn 2 evaluates only the new text with the plugin, where the host evaluates everything again: Q4_K_M kernels
    give slightly batch-dependent logits (docs/correctness.md), so turn 2 is compared on its first token."""
    from llama_cpp import Llama

    projector = write_tiny_mmproj(tmp_path / "mmproj-640.gguf", text_n_embd=640, image_size=56)

    def open_vision(attached: bool) -> tuple[Any, CountingMtmd]:
        handler = Llava15ChatHandler(clip_model_path=str(projector), verbose=False)
        counting = CountingMtmd(handler._mtmd_cpp)
        handler._mtmd_cpp = counting
        llama = Llama(str(gemma_path), n_ctx=2048, n_batch=512, n_threads=2, swa_full=False, verbose=False, seed=0,
                      chat_handler=handler)
        if attached:
            ckpt_plugin.attach(llama)
        return llama, counting

    def flow(llama: Any) -> list[str]:
        first = [user("Describe the picture.", 11)]
        answer = reply(llama, first)
        other = reply(llama, [user("Describe the picture.", 12)])
        second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Which colours?"}]
        response = llama.create_chat_completion(messages=second, temperature=0.0, max_tokens=1)
        return [answer, other, response["choices"][0]["message"]["content"] or ""]

    host, _ = open_vision(False)
    expected = flow(host)
    host.close()
    attached, count = open_vision(True)
    try:
        assert flow(attached) == expected
        assert count.media_chunks == 2  # turn 2 restores image 11 from the cache: not encoded again
    finally:
        attached.close()


def test_an_image_moves_between_replicas_through_the_shared_tier(tiny_model: Any, mmproj: pathlib.Path,
                                                                 tmp_path: pathlib.Path) -> None:
    """Turn 1 on one replica, turn 2 on the other: the image's positions come from Redis, keyed by its content."""
    import time

    from support.redis_servers import run_redis

    args = model_args(tiny_model("llama"), n_ctx=512, flash_attn="false") + [
        "--chat_format", "llava-1-5", "--clip_model_path", str(mmproj)]
    first = [user("what is this?", 8)]

    def ask(server: Any, messages: list[dict[str, Any]]) -> dict[str, Any]:
        response = server.post("/v1/chat/completions", json={"messages": messages, "temperature": 0,
                                                              "max_tokens": MAX_TOKENS, "repeat_penalty": 1.0})
        assert response.status_code == 200, response.text
        return dict(response.json())

    with run_server(args, plain=True) as plain:
        answer = ask(plain, first)["choices"][0]["message"]["content"]
        second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "and now?"}]
        expected = ask(plain, second)
    with run_redis(tmp_path) as redis:
        # Plans by tokens: on a tiny model, whether a fetch pays depends on the machine's timing at that moment.
        shared = ["--checkpoint-redis-url", redis.url, "--checkpoint-redis-prefix", "vision", "--plan-by-cost", "false"]
        with run_server(args + shared) as a, run_server(args + shared) as b:
            assert ask(a, first)["choices"][0]["message"]["content"] == answer
            deadline = time.monotonic() + 15
            while a.metric("shared_writes_total") < 1:
                assert time.monotonic() < deadline, "no entry reached the shared tier"
                time.sleep(0.05)
            moved = ask(b, second)
            assert moved["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
            # Everything up to the end of turn 1's prompt came from the tier, the image included.
            assert moved["usage"]["prompt_tokens_details"]["cached_tokens"] >= expected["usage"]["prompt_tokens"] // 2
            assert b.metric("shared_hits_total") == 1


@pytest.mark.parametrize("kind", ["gemma3", "hybrid"])
def test_a_llava_sized_image_past_the_window_and_the_batch(make_llama: Callable[..., Any], tmp_path: pathlib.Path,
                                                           kind: str) -> None:
    """576 positions an image (llava-1.5's grid): longer than the sliding window (32) and than a batch (512)."""
    projector = write_tiny_mmproj(tmp_path / "mmproj-336.gguf", image_size=336)
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_data_uri(tiny_png(9, width=336))}},
        {"type": "text", "text": "Describe the picture."}]}]

    def flow(attached: bool) -> tuple[str, str]:
        handler = Llava15ChatHandler(clip_model_path=str(projector), verbose=False)
        llama = make_llama(kind, chat_handler=handler, n_ctx=2048, n_batch=512, n_ubatch=512)
        if attached:
            ckpt_plugin.attach(llama)
        first = reply(llama, messages)
        return first, reply(llama, messages + [{"role": "assistant", "content": first},
                                               {"role": "user", "content": "Which colours?"}])

    assert flow(True) == flow(False)


WORDS = ["what", "is", "this", "the", "cat", "colour", "and", "now", "left", "right", "picture", "again"]
_turn = st.tuples(st.lists(st.integers(20, 24), max_size=2), st.lists(st.sampled_from(WORDS), min_size=1, max_size=5))
_conversation = st.lists(_turn, min_size=1, max_size=3)


@pytest.mark.parametrize("kind", ["llama", "gemma3", "mamba", "hybrid"])
def test_random_vision_conversations_answer_as_the_host_alone(make_llama: Callable[..., Any],
                                                              mmproj: pathlib.Path, kind: str) -> None:
    """Random conversations over a few images (0-2 an turn, from 5), edits and branches among them (a later
    request may keep, cut or change any earlier turn), on an attached ``Llama`` and on the host alone."""
    host, _ = vision(make_llama, mmproj, kind, attached=False)
    attached, _ = vision(make_llama, mmproj, kind, attached=True)

    @settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(requests=st.lists(_conversation, min_size=2, max_size=4))
    def check(requests: list[list[tuple[list[int], list[str]]]]) -> None:
        for turns in requests:
            messages: list[dict[str, Any]] = []
            for index, (seeds, words) in enumerate(turns):
                if index:
                    messages.append({"role": "assistant", "content": " ".join(words[:2])})
                messages.append(user(" ".join(words), *seeds))
            assert reply(attached, messages) == reply(host, messages)

    check()


def test_a_vision_request_whose_client_left_ends_without_a_token(make_llama: Callable[..., Any],
                                                                 mmproj: pathlib.Path) -> None:
    """The handler's chunks are passed over, its completion ends at once (no error for the host to turn into a
    500), and the next request answers as the host alone."""
    from ckpt_plugin.core.request import RequestScope, current_request

    host, _ = vision(make_llama, mmproj, "gemma3", attached=False)
    llama, count = vision(make_llama, mmproj, "gemma3", attached=True)
    messages = [user("what is this?", 13)]
    scope = RequestScope()
    scope.cancelled.set()
    token = current_request.set(scope)
    try:
        response = llama.create_chat_completion(messages=messages, temperature=0.0, max_tokens=MAX_TOKENS)
    finally:
        current_request.reset(token)
    assert response["choices"][0]["message"]["content"] == ""
    assert response["choices"][0]["finish_reason"] == "length"
    assert count.media_chunks == 0
    assert reply(llama, messages) == reply(host, messages)
