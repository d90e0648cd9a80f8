"""vLLM's prompt-rendering routes on ckpt-serve (``/v1/chat/completions/render``, ``/v1/completions/render``,
``/tokenize``): the token ids are exactly the prompt the same request then evaluates (``usage.prompt_tokens``, and
the tokens the slot holds after a one-token reply, read from its slot file), for chats, tools, completions and images
(their positions as the ids the engine stores them under); they are answered while every slot generates (no slot,
no lock); a malformed body gets a 4xx JSON error, never a 500; nothing of any tenant shows; and a server that
drops a stream mid-way, runs streams side by side and answers renders and health checks between them answers the
next request as it would alone."""

from __future__ import annotations

import json
import pathlib
from typing import Any, Iterator

import httpx
import pytest

from ckpt_plugin.persist.read import read_entry
from ckpt_plugin.testing.tiny_models import (
    BOS_ID,
    image_data_uri,
    mmproj_positions_per_image,
    tiny_png,
    write_tiny_mmproj,
)
from ckpt_plugin.testing.waiting import wait_until
from support.busy import BOUND, HEALTH_NO_SLOT, no_slot_free, slots_held
from support.concurrency import all_at_once
from support.near_ties import reference, same_or_near_tie
from support.servers import client, drop_stream, model_args, run_server

CHATS = [
    [{"role": "user", "content": "hello there"}],
    [{"role": "system", "content": "you are a cat"}, {"role": "user", "content": "what is it that you want?"},
     {"role": "assistant", "content": "the dog"}, {"role": "user", "content": "and then? ünïcødé ✓"}],
]
PROMPTS = ["hello there", "the cat and the dog went to the house", "ünïcødé ✓ <s> 42"]
GENERATE_REQUEST_KEYS = {"request_id", "token_ids", "features", "sampling_params", "model", "stream",
                         "stream_options", "cache_salt", "priority", "kv_transfer_params"}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def post(server: Any, path: str, body: Any, **headers: str) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=BOUND)


def render_chat(server: Any, body: dict[str, Any]) -> dict[str, Any]:
    response = post(server, "/v1/chat/completions/render", {"model": "m", **body})
    assert response.status_code == 200, response.text
    rendered = response.json()
    assert set(rendered) == GENERATE_REQUEST_KEYS and rendered["request_id"].startswith("chatcmpl-")
    return rendered


def render_completion(server: Any, prompt: str) -> list[int]:
    response = post(server, "/v1/completions/render", {"model": "m", "prompt": prompt, "max_tokens": 4})
    assert response.status_code == 200, response.text
    (rendered,) = response.json()
    assert set(rendered) == GENERATE_REQUEST_KEYS and rendered["request_id"].startswith("cmpl-")
    return rendered["token_ids"]


def tokenize(server: Any, body: dict[str, Any]) -> list[int]:
    response = post(server, "/tokenize", {"model": "m", **body})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] > 0
    return answer["tokens"]


def slot_holds(server: Any, directory: pathlib.Path, tokens: list[int]) -> bool:
    """Whether a slot holds exactly ``tokens`` (every slot is saved to a file and read back)."""
    slots = httpx.get(f"{server.url}/slots", timeout=BOUND).json()
    for slot in slots:
        name = f"check-{slot['id']}.bin"
        saved = post(server, f"/slots/{slot['id']}?action=save", {"filename": name})
        if saved.status_code == 200 and read_entry(directory / name).tokens.tolist() == tokens:
            return True
    return False


def evaluate_chat(server: Any, body: dict[str, Any]) -> int:
    """Run the chat for one token; the prompt tokens it reports."""
    response = post(server, "/v1/chat/completions", {"model": "m", "max_tokens": 1, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens"]


@pytest.fixture(scope="module")
def slot_files(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("slot-files")


@pytest.fixture(scope="module")
def two_slots(tiny_model: Any, slot_files: pathlib.Path) -> Iterator[Any]:
    args = model_args(tiny_model("llama")) + ["--parallel", "2", "--slot-save-path", str(slot_files / "two")]
    with run_server(args) as server:
        yield server


@pytest.mark.parametrize("messages", CHATS, ids=["one-turn", "four-turns"])
def test_chat_render_is_the_prompt_the_chat_evaluates(two_slots: Any, slot_files: pathlib.Path,
                                                      messages: list[dict[str, str]]) -> None:
    rendered = render_chat(two_slots, {"messages": messages, "max_tokens": 7, "stream": True})
    tokens = rendered["token_ids"]
    assert rendered["features"] is None and rendered["stream"] is True and rendered["model"] == "m"
    assert rendered["sampling_params"]["max_tokens"] == 7
    assert tokenize(two_slots, {"messages": messages}) == tokens
    assert evaluate_chat(two_slots, {"messages": messages}) == len(tokens)
    assert slot_holds(two_slots, slot_files / "two", tokens)


def test_completion_render_and_tokenize_are_the_prompt_the_completion_evaluates(two_slots: Any,
                                                                                slot_files: pathlib.Path) -> None:
    for prompt in PROMPTS:
        tokens = render_completion(two_slots, prompt)
        assert tokens[0] == BOS_ID and tokenize(two_slots, {"prompt": prompt}) == tokens
        assert tokenize(two_slots, {"prompt": prompt, "add_special_tokens": False}) == tokens[1:]
        response = post(two_slots, "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 1,
                                                      "temperature": 0})
        assert response.json()["usage"]["prompt_tokens"] == len(tokens)
        assert slot_holds(two_slots, slot_files / "two", tokens)
    strings = post(two_slots, "/tokenize", {"prompt": "hello there", "return_token_strs": True}).json()
    assert len(strings["token_strs"]) == strings["count"] and "".join(strings["token_strs"][1:]) == " hello there"


def test_tools_are_rendered_as_the_chat_format_writes_them(tiny_model: Any, tmp_path: pathlib.Path) -> None:
    args = model_args(tiny_model("llama")) + ["--chat_format", "chatml-function-calling", "--slot-save-path",
                                              str(tmp_path)]
    messages = [{"role": "user", "content": "the weather in paris?"}]
    body = {"messages": messages, "tools": TOOLS, "tool_choice": {"type": "function",
                                                                  "function": {"name": "get_weather"}}}
    with run_server(args) as server:
        tokens = render_chat(server, body)["token_ids"]
        assert len(tokens) > len(render_chat(server, {"messages": messages})["token_ids"])  # the tools are in it
        assert tokenize(server, {"messages": messages, "tools": TOOLS}) == render_chat(
            server, {"messages": messages, "tools": TOOLS})["token_ids"]
        assert evaluate_chat(server, body) == len(tokens)
        assert slot_holds(server, tmp_path, tokens)


@pytest.mark.parametrize("parallel", [1, 2])
def test_images_render_as_the_ids_their_positions_are_stored_under(tiny_model: Any, tmp_path: pathlib.Path,
                                                                   parallel: int) -> None:
    mmproj = write_tiny_mmproj(tmp_path / "mmproj.gguf")
    args = model_args(tiny_model("gemma3"), n_ctx=512) + [
        "--chat_format", "llava-1-5", "--clip_model_path", str(mmproj), "--parallel", str(parallel),
        "--slot-save-path", str(tmp_path / "slots")]
    image = {"type": "image_url", "image_url": {"url": image_data_uri(tiny_png(3))}}
    messages = [{"role": "system", "content": "describe it"},
                {"role": "user", "content": [image, {"type": "text", "text": "what is in it?"}]}]
    with run_server(args) as server:
        rendered = render_chat(server, {"messages": messages})
        tokens = rendered["token_ids"]
        (place,) = rendered["features"]["mm_placeholders"]["image"]
        offset, length = place["offset"], place["length"]
        assert length == mmproj_positions_per_image()
        assert [i for i, token in enumerate(tokens) if token < 0] == list(range(offset, offset + length))
        (digest,) = rendered["features"]["mm_hashes"]["image"]
        assert len(digest) == 64
        # The same image renders the same ids; another, others.
        assert render_chat(server, {"messages": messages})["token_ids"] == tokens
        other = [messages[0], {"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": image_data_uri(tiny_png(4))}}, {"type": "text", "text": "what is in it?"}]}]
        assert render_chat(server, {"messages": other})["token_ids"][offset:offset + length] != tokens[
            offset:offset + length]
        assert tokenize(server, {"messages": messages}) == tokens
        assert evaluate_chat(server, {"messages": messages}) == len(tokens)
        assert slot_holds(server, tmp_path / "slots", tokens)


def test_renders_answer_while_every_slot_generates(two_slots: Any) -> None:
    chat_body = {"messages": CHATS[1]}
    idle = (render_chat(two_slots, chat_body)["token_ids"], render_completion(two_slots, PROMPTS[1]),
            tokenize(two_slots, {"messages": CHATS[0]}))
    with slots_held(two_slots, 2):
        busy = (render_chat(two_slots, chat_body)["token_ids"], render_completion(two_slots, PROMPTS[1]),
                tokenize(two_slots, {"messages": CHATS[0]}))
        assert no_slot_free(two_slots)  # still: the renders were answered while both slots generated
    assert busy == idle


def test_a_server_with_one_slot_renders_while_its_slot_generates(tiny_model: Any) -> None:
    with run_server(model_args(tiny_model("llama"))) as server:
        idle = render_chat(server, {"messages": CHATS[1]})["token_ids"]
        with slots_held(server, 1):
            assert render_chat(server, {"messages": CHATS[1]})["token_ids"] == idle
            assert no_slot_free(server)


MALFORMED: list[tuple[str, Any]] = [
    ("/v1/chat/completions/render", [1, 2]),
    ("/v1/chat/completions/render", "text"),
    ("/v1/chat/completions/render", {}),
    ("/v1/chat/completions/render", {"messages": []}),
    ("/v1/chat/completions/render", {"messages": "hello"}),
    ("/v1/chat/completions/render", {"messages": [{"role": "nobody", "content": "x"}]}),
    ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": 5}]}),
    ("/v1/chat/completions/render", {"messages": [{"role": "user"}]}),
    ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}),
    ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}),
    ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                                     "tool_choice": {"type": "function", "function": {"name": "nothing"}}}),
    ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": "the cat " * 3000}]}),
    ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": "x"}], "grammar": "root ::= ("}),
    ("/v1/completions/render", {"prompt": ["one", "two"]}),
    ("/v1/completions/render", {"prompt": 42}),
    ("/v1/completions/render", {"prompt": "the cat " * 3000}),
    ("/v1/completions/render", {"prompt": "x", "temperature": "hot"}),
    ("/tokenize", {}),
    ("/tokenize", {"prompt": ["x"]}),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False}),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ messages }}"}),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_special_tokens": True}),
    ("/tokenize", {"messages": []}),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "return_token_strs": "often"}),
]


def test_malformed_bodies_get_a_json_4xx(two_slots: Any) -> None:
    for path, body in MALFORMED:
        response = post(two_slots, path, body)
        assert 400 <= response.status_code < 500, (path, body, response.status_code, response.text)
        assert response.json()["error"]["message"], (path, body)
    for path in ("/v1/chat/completions/render", "/v1/completions/render", "/tokenize"):
        for content, headers in ((b"{", {"content-type": "application/json"}), (b"\xff\xfe", {}),
                                 (b'{"prompt": "x"}', {"content-type": "text/plain"}),
                                 (b'{"a":' * 5000, {"content-type": "application/json"})):
            response = httpx.post(f"{two_slots.url}{path}", content=content, headers=headers, timeout=BOUND)
            assert 400 <= response.status_code < 500 and response.json()["error"], (path, content[:20], response.text)
    assert render_chat(two_slots, {"messages": CHATS[0]})["token_ids"]


def test_renders_show_nothing_of_tenants(tiny_model: Any) -> None:
    args = model_args(tiny_model("llama")) + ["--parallel", "2", "--api_key", "tenant-key", "--admin-key", "op-key",
                                              "--namespaces", "api_key", "--admin", "true"]
    body = {"model": "m", "messages": CHATS[1]}
    with run_server(args) as server:
        assert post(server, "/v1/chat/completions/render", body).status_code == 401
        assert post(server, "/tokenize", {"prompt": "x"}, Authorization="Bearer wrong").status_code == 401
        client(server, "tenant-key", timeout=BOUND).chat.completions.create(model="m", messages=CHATS[1],
                                                                            max_tokens=4)
        answers = [post(server, "/v1/chat/completions/render", body, Authorization=f"Bearer {key}").json()
                   for key in ("tenant-key", "op-key")]
        assert answers[0]["token_ids"] == answers[1]["token_ids"]
        for answer in answers:
            text = json.dumps(answer)
            assert "key:" not in text and "tenant-key" not in text and "namespace" not in text
            assert answer["cache_salt"] is None


def test_a_server_with_several_models_does_not_render(tiny_model: Any, tmp_path: pathlib.Path) -> None:
    config = {"models": [{"model": str(tiny_model("llama")), "model_alias": "a", "n_ctx": 512},
                         {"model": str(tiny_model("gemma3")), "model_alias": "b", "n_ctx": 512}]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with run_server(["--config_file", str(tmp_path / "config.json")]) as server:
        response = post(server, "/v1/chat/completions/render", {"model": "a", "messages": CHATS[0]})
        assert response.status_code == 501 and response.json()["error"]["code"] == "not_supported"
        assert httpx.get(f"{server.url}/health", timeout=BOUND).json() == {"status": "ok"}


def test_drops_parallel_streams_and_mixed_routes_then_the_next_request_answers(two_slots: Any, plain: Any) -> None:
    statuses: list[tuple[str, int]] = []
    expected = (render_chat(two_slots, {"messages": CHATS[1]})["token_ids"], render_completion(two_slots, PROMPTS[0]))

    def streams(i: int) -> None:
        for turn in range(2):
            messages = [{"role": "user", "content": f"story {i} part {turn}"}]
            reply = client(two_slots, timeout=BOUND).chat.completions.create(
                model="m", messages=messages, max_tokens=24, temperature=0, stream=True)
            text = "".join(chunk.choices[0].delta.content or "" for chunk in reply if chunk.choices)
            assert same_or_near_tie(text, reference(plain, messages, max_tokens=24))
            drop_stream(two_slots, messages, 3, max_tokens=300, timeout=BOUND)

    def others() -> None:
        with httpx.Client(base_url=two_slots.url, timeout=BOUND) as http:
            for _ in range(8):
                for method, path, body in (("GET", "/health", None), ("GET", "/health?fail_on_no_slot=1", None),
                                           ("POST", "/v1/chat/completions/render", {"messages": CHATS[1]}),
                                           ("POST", "/v1/completions/render", {"prompt": PROMPTS[0]}),
                                           ("POST", "/tokenize", {"messages": CHATS[1]}),
                                           ("POST", "/v1/chat/completions/render", {"messages": "broken"})):
                    response = http.request(method, path, json=body)
                    statuses.append((path, response.status_code))
                    if response.status_code == 200 and path == "/v1/chat/completions/render":
                        assert response.json()["token_ids"] == expected[0]
                    if response.status_code == 200 and path == "/v1/completions/render":
                        assert response.json()[0]["token_ids"] == expected[1]
                    if path == "/tokenize":
                        assert response.json()["tokens"] == expected[0]
                    if response.status_code == 503:
                        assert response.json() == HEALTH_NO_SLOT

    all_at_once([lambda i=i: streams(i) for i in range(2)] + [others, others])
    readiness = "/health?fail_on_no_slot=1"
    assert all(status < 500 for path, status in statuses if path != readiness), statuses
    assert {status for path, status in statuses if path == "/health"} == {200}
    assert {status for path, status in statuses if path == readiness} <= {200, 503}
    assert {status for path, status in statuses if "render" in path or path == "/tokenize"} <= {200, 422}
    wait_until(lambda: not no_slot_free(two_slots), BOUND)
    messages = [{"role": "user", "content": "after the storm"}]
    rendered = render_chat(two_slots, {"messages": messages})["token_ids"]
    reply = client(two_slots, timeout=BOUND).chat.completions.create(model="m", messages=messages, max_tokens=16,
                                                                      temperature=0)
    assert same_or_near_tie(reply.choices[0].message.content or "", reference(plain, messages))
    assert reply.usage.prompt_tokens == len(rendered)
