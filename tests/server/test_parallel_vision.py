"""Images on any slot of ``ckpt-serve --parallel N``, through real HTTP with concurrent clients: llama-cpp-python's
multimodal chat handler (llava-1-5) with a real (tiny, random-weight) projector that libmtmd loads, on the tiny
Gemma-3-like model (whose greedy answers depend on the image).

The handler evaluates its prompt (text and image chunks) on the slot its request leases, the image decoded into
that slot's sequence and keyed by its content, so a follow-up about an image reuses it on whichever slot it lands
(the one that holds it, or another, restored from the cache), within the tenant's own namespace. Every reply is the
one the same request gets on one slot (``--parallel 1``), or leaves it only at a near tie (a batch of several
sequences rounds differently, docs/server.md, "Numerics"). Reuse is read from counters: ``media_chunks`` (images
the projector encoded) in ``/checkpoints/stats`` and ``cached_tokens`` in ``usage``, never from timings.
"""

from __future__ import annotations

import pathlib
from typing import Any, Callable, Iterator

import httpx
import pytest

from ckpt_plugin.testing.tiny_models import image_data_uri, mmproj_positions_per_image, tiny_png, write_tiny_mmproj
from support.concurrency import all_at_once
from support.near_ties import NEAR_TIE, reference, same_or_near_tie
from support.servers import client, drop_stream, model_args, run_server

BOUND = 90.0
MAX_TOKENS = 8
"""Margins under which a batched step's rounding may pick the runner-up (as in test_parallel_server.py)."""
SYSTEM = "You describe pictures in a few words, plainly and without any guessing."


def user(text: str, *seeds: int) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": image_data_uri(tiny_png(seed))}}
                                     for seed in seeds]
    content.append({"type": "text", "text": text})
    return {"role": "user", "content": content}


def first_turn(i: int, seed: int | None = None) -> list[dict[str, Any]]:
    """Conversation ``i``'s first turn: a question about its own image (``seed``, by default 30 + ``i``)."""
    return [{"role": "system", "content": SYSTEM}, user(f"what is in picture {i}?", 30 + i if seed is None else seed)]


def follow_up(messages: list[dict[str, Any]], answer: str) -> list[dict[str, Any]]:
    """The next turn: the same image, turn 1's answer, a new question."""
    return messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": "and its colours?"}]


def text_chat(i: int) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"tell me a story about {i} cats"}]


def ask(server: Any, messages: list[dict[str, Any]], *, stream: bool = False, api_key: str = "none") -> tuple[str, Any]:
    """The reply's text, and its usage (``None`` for a stream)."""
    chat = client(server, api_key, timeout=BOUND).chat.completions
    if stream:
        chunks = chat.create(model="m", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True)
        return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices), None
    reply = chat.create(model="m", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    return reply.choices[0].message.content or "", reply.usage


def stats(server: Any) -> dict[str, Any]:
    """The stats of the server's one model."""
    (model,) = httpx.get(f"{server.url}/checkpoints/stats", timeout=BOUND).json()["models"].values()
    return dict(model)


def wait_until_idle(server: Any, bound: float = 10.0) -> None:
    """Every slot is free within ``bound`` seconds."""
    import time

    deadline = time.monotonic() + bound
    while any(slot["is_processing"] for slot in httpx.get(f"{server.url}/slots", timeout=10).json()):
        assert time.monotonic() < deadline, "a request kept its slot"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def vision_args(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    mmproj = write_tiny_mmproj(pathlib.Path(tmp_path_factory.mktemp("mmproj")) / "mmproj.gguf")
    return model_args(tiny_model("gemma3"), n_ctx=512) + ["--chat_format", "llava-1-5", "--clip_model_path",
                                                          str(mmproj), "--admin", "true"]


@pytest.fixture(scope="module")
def one_slot(vision_args: list[str]) -> Iterator[Any]:
    """The same server with one slot: the replies the parallel one must give."""
    with run_server(vision_args) as server:
        yield server


@pytest.fixture(scope="module")
def four_slots(vision_args: list[str]) -> Iterator[Any]:
    with run_server(vision_args + ["--parallel", "4"]) as server:
        yield server


def test_four_concurrent_vision_chats_answer_as_one_slot_and_reuse_their_images(one_slot: Any,
                                                                                four_slots: Any) -> None:
    firsts = [first_turn(i) for i in range(4)]
    expected = [reference(one_slot, m, MAX_TOKENS) for m in firsts]
    assert len({text for text, _ in expected}) > 1, "the images must get different answers for the test to tell"
    before = stats(four_slots)
    got = all_at_once([lambda m=m, i=i: ask(four_slots, m, stream=i % 2 == 1) for i, m in enumerate(firsts)])
    assert all(same_or_near_tie(text, want) for (text, _), want in zip(got, expected)), (got, expected)
    turn_one = stats(four_slots)
    assert turn_one["media_chunks"] - before["media_chunks"] == 4  # each image encoded once, on its own slot

    seconds = [follow_up(m, want[0]) for m, want in zip(firsts, expected)]
    expected_second = [reference(one_slot, m, MAX_TOKENS) for m in seconds]
    again = all_at_once([lambda m=m: ask(four_slots, m) for m in seconds])
    assert all(same_or_near_tie(text, want) for (text, _), want in zip(again, expected_second)), again
    turn_two = stats(four_slots)
    # No image encoded again: each follow-up restored its image (and turn 1) from a slot or the cache, and evaluated
    # only turn 1's answer, the new question and its reply.
    assert turn_two["media_chunks"] == turn_one["media_chunks"]
    positions = mmproj_positions_per_image()
    for _, usage in again:
        assert usage.prompt_tokens_details.cached_tokens > positions + 20
    evaluated = turn_two["tokens_evaluated"] - turn_one["tokens_evaluated"]
    assert evaluated <= sum(u.prompt_tokens - u.prompt_tokens_details.cached_tokens + u.completion_tokens
                            for _, u in again)
    assert turn_two["stood_aside"] == 0


def test_text_and_vision_requests_together(one_slot: Any, four_slots: Any) -> None:
    """Seven requests on four slots (three wait in the queue), text and images mixed, streamed and not, one vision
    request reading logprobs (the rows of its prompt's last token on)."""
    requests = [first_turn(10), text_chat(1), first_turn(11), text_chat(2), first_turn(10), text_chat(3)]
    expected = [reference(one_slot, m, MAX_TOKENS) for m in requests]
    with_logprobs = reference(one_slot, first_turn(12), MAX_TOKENS)
    calls: list[Callable[[], Any]] = [lambda m=m, i=i: ask(four_slots, m, stream=i % 3 == 0)[0]
                                      for i, m in enumerate(requests)]
    got = all_at_once([*calls, lambda: reference(four_slots, first_turn(12), MAX_TOKENS)[0]])
    assert all(same_or_near_tie(text, want) for text, want in zip(got, [*expected, with_logprobs])), (got, expected)
    wait_until_idle(four_slots)


def test_a_client_that_leaves_a_vision_stream_frees_its_slot(one_slot: Any, four_slots: Any) -> None:
    """Streams dropped mid-way (one while an image is in the batch beside it): their slots are freed, the other
    request runs to its end, and the next requests, a follow-up about the dropped stream's image among them, answer
    as on one slot."""
    dropped = first_turn(20)
    keep = first_turn(21)
    expected = reference(one_slot, keep, MAX_TOKENS)
    results = all_at_once([
        lambda: drop_stream(four_slots, dropped, 3, max_tokens=200, timeout=BOUND),  # type: ignore[arg-type]
        lambda: ask(four_slots, keep, stream=True)[0],
        lambda: drop_stream(four_slots, first_turn(22), 2, max_tokens=200, timeout=BOUND),  # type: ignore[arg-type]
    ])
    assert same_or_near_tie(results[1], expected), (results[1], expected)
    wait_until_idle(four_slots)
    before = stats(four_slots)
    again = follow_up(dropped, "a picture")
    want = reference(one_slot, again, MAX_TOKENS)
    text, usage = ask(four_slots, again)
    assert same_or_near_tie(text, want), (text, want)
    assert stats(four_slots)["media_chunks"] == before["media_chunks"]  # the dropped stream's image was kept
    assert usage.prompt_tokens_details.cached_tokens > mmproj_positions_per_image()
    assert same_or_near_tie(ask(four_slots, keep)[0], expected)


def test_images_move_between_slots_within_a_tenant_only(vision_args: list[str], one_slot: Any) -> None:
    """Two slots: a conversation whose slot another request took meanwhile resumes on the other slot (the least
    recently used, where no slot holds a prefix of it), its image restored from the cache; another tenant sending the
    same image and words encodes the image again."""
    tenants = ["--namespaces", "api_key", "--admin-key", "operator"]
    with run_server(vision_args + ["--parallel", "2", *tenants]) as server:
        admin = {"Authorization": "Bearer operator"}

        def counters() -> dict[str, Any]:
            (model,) = httpx.get(f"{server.url}/checkpoints/stats", headers=admin,
                                 timeout=BOUND).json()["models"].values()
            return dict(model)

        first = first_turn(40)
        answer, _ = ask(server, first, api_key="tenant-a")
        assert same_or_near_tie(answer, reference(one_slot, first, MAX_TOKENS))
        # Two other tenants, one after the other: the first gets the empty slot, the second (no prefix shared with
        # either slot in its namespace) the least recently used one, tenant a's, whose conversation goes to the cache.
        ask(server, text_chat(50), api_key="tenant-c")
        ask(server, text_chat(51), api_key="tenant-d")
        before = counters()
        second = follow_up(first, answer)
        text, usage = ask(server, second, api_key="tenant-a")
        assert same_or_near_tie(text, reference(one_slot, second, MAX_TOKENS))
        after = counters()
        assert after["media_chunks"] == before["media_chunks"]
        assert after["tokens_reused_from_cache"] > before["tokens_reused_from_cache"]
        assert usage.prompt_tokens_details.cached_tokens > mmproj_positions_per_image()
        # The same image and words from another tenant: nothing of tenant a's is reused.
        text, usage = ask(server, first, api_key="tenant-b")
        assert same_or_near_tie(text, reference(one_slot, first, MAX_TOKENS))
        assert counters()["media_chunks"] == after["media_chunks"] + 1
        assert usage.prompt_tokens_details.cached_tokens == 0
