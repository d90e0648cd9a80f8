"""ckpt-serve through real HTTP with the openai client, against plain llama_cpp.server."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import httpx

HTTP = httpx.Client(timeout=120)
import openai
import pytest

from support.servers import client, model_args, run_server

MAX_TOKENS = 6
SYSTEM = [
    "the cat and the dog went to the house " * 12,
    "one two three four five six seven eight nine ten " * 10,
    "is it that this was the one we had in mind " * 11,
]
USER_TURNS = ["hello world", "and then the dog", "what is it", "one more time"]


def chat(c: openai.OpenAI, messages: list[dict[str, str]]) -> Any:
    return c.chat.completions.create(model="m", messages=messages, max_tokens=MAX_TOKENS, temperature=0)


def interleaved(servers: list[Any], turns: int = 3) -> list[list[Any]]:
    """Users take turns round-robin; every server gets the same conversation; returns responses per server."""
    conversations = [[{"role": "system", "content": s}] for s in SYSTEM]
    results: list[list[Any]] = [[] for _ in servers]
    for turn in range(turns):
        for user, messages in enumerate(conversations):
            messages.append({"role": "user", "content": USER_TURNS[(turn + user) % len(USER_TURNS)]})
            responses = [chat(client(s), messages) for s in servers]
            for i, response in enumerate(responses):
                results[i].append((turn, user, response))
            messages.append({"role": "assistant", "content": responses[0].choices[0].message.content})
    return results


def assert_previous_prompt_reused(results: list[Any], slack: int = 0) -> None:
    """From the second turn on, a user's whole previous prompt is served without evaluation (``slack``: a
    checkpoint-served prompt restores from one token before the previous prompt's end)."""
    previous: dict[int, int] = {}
    for turn, user, response in results:
        if turn > 0:
            assert response.usage.prompt_tokens_details.cached_tokens >= previous[user] - slack, (turn, user)
        previous[user] = response.usage.prompt_tokens


def test_interleaved_chat_equals_plain_server_and_evaluates_only_new_tokens(tiny_model: Any) -> None:
    path = tiny_model("llama")
    with run_server(model_args(path)) as ours, run_server(model_args(path), plain=True) as plain:
        evaluated_before = ours.metric("tokens_evaluated_total")
        ours_results, plain_results = interleaved([ours, plain])
        for (turn, user, mine), (_, _, theirs) in zip(ours_results, plain_results):
            assert mine.choices[0].message.content == theirs.choices[0].message.content, (turn, user)
        assert_previous_prompt_reused(ours_results)
        evaluated = ours.metric("tokens_evaluated_total") - evaluated_before
        # the last sampled token is evaluated only if the reply continues; a reply cut by max_tokens ends there
        new_tokens = sum(r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens
                         + r.usage.completion_tokens - (r.choices[0].finish_reason == "length")
                         for _, _, r in ours_results)
        assert evaluated == new_tokens


def test_sliding_window_model_reuses_through_checkpoints(tiny_model: Any) -> None:
    path = tiny_model("gemma3")
    args = model_args(path) + ["--checkpoint-min-step", "32"]
    with run_server(args) as ours:
        results = interleaved([ours])[0]
        assert_previous_prompt_reused(results, slack=1)
        assert ours.metric("cache_hits_total") >= 2 * len(SYSTEM) - 1


def test_streamed_usage_reports_cached_tokens(tiny_model: Any) -> None:
    with run_server(model_args(tiny_model("llama"))) as ours:
        c = client(ours)
        messages = [{"role": "system", "content": SYSTEM[0]}, {"role": "user", "content": "hello"}]
        chat(c, messages)
        stream = c.chat.completions.create(model="m", messages=messages + [{"role": "user", "content": "again"}],
                                           max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        usage = [chunk.usage for chunk in stream if chunk.usage]
        assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens > 50
        completion = c.completions.create(model="m", prompt=SYSTEM[1], max_tokens=3, temperature=0)
        assert completion.usage.prompt_tokens_details.cached_tokens >= 0


@pytest.mark.parametrize("parallel", ["1", "2"])
def test_streamed_usage_counts_the_tokens_generated_as_the_response_does(tiny_model: Any, parallel: str) -> None:
    """A stream's ``usage`` (which ckpt-serve adds) reports the ``completion_tokens`` of the same request not
    streamed: the tokens generated, those of the stop string that ended it included, not the chunks of text sent."""
    with run_server(model_args(tiny_model("llama")) + ["--parallel", parallel]) as ours:
        c = client(ours)
        prompt = SYSTEM[2]
        whole = c.completions.create(model="m", prompt=prompt, max_tokens=16, temperature=0).choices[0].text
        stop = whole[len(whole) // 2 : len(whole) // 2 + 2]
        assert stop.strip(), whole
        plain = c.completions.create(model="m", prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
        assert plain.choices[0].finish_reason == "stop"
        chunks = texts = 0
        usage = None
        for chunk in c.completions.create(model="m", prompt=prompt, max_tokens=16, temperature=0, stop=[stop],
                                          stream=True, stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].text:
                chunks += 1
            usage = chunk.usage or usage
        assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens
        assert usage.completion_tokens > chunks  # the stop string's tokens were generated, their text not sent


def test_tenants_never_hit_each_other(tiny_model: Any) -> None:
    args = model_args(tiny_model("llama")) + ["--checkpoint-namespaces", "api_key"]
    with run_server(args) as ours:
        messages = [{"role": "system", "content": SYSTEM[0]}, {"role": "user", "content": "hello"}]
        a, b = client(ours, "tenant-a-key"), client(ours, "tenant-b-key")
        chat(a, messages)
        assert chat(a, messages).usage.prompt_tokens_details.cached_tokens > 50
        assert chat(b, messages).usage.prompt_tokens_details.cached_tokens == 0
        assert chat(a, messages).usage.prompt_tokens_details.cached_tokens > 50  # A's state was parked, not lost


def test_admin_routes_off_by_default_and_protected_by_the_api_key(tiny_model: Any) -> None:
    with run_server(model_args(tiny_model("llama"))) as ours:
        response = HTTP.get(f"{ours.url}/checkpoints")
        assert response.status_code == 404 and "error" in response.json()
    args = model_args(tiny_model("llama")) + ["--api_key", "secret", "--checkpoint-admin", "true"]
    with run_server(args) as ours:
        chat(client(ours, "secret"), [{"role": "user", "content": "hello"}])
        assert HTTP.get(f"{ours.url}/checkpoints").status_code == 401
        assert HTTP.get(f"{ours.url}/metrics").status_code == 401
        auth = {"Authorization": "Bearer secret"}
        view = HTTP.get(f"{ours.url}/checkpoints", headers=auth).json()
        assert "models" in view and view["models"]
        assert HTTP.get(f"{ours.url}/checkpoints/stats", headers=auth).json()["models"]
        assert "ckpt_tokens_evaluated_total" in HTTP.get(f"{ours.url}/metrics", headers=auth).text
        assert HTTP.post(f"{ours.url}/checkpoints", headers=auth).status_code == 405
        assert HTTP.delete(f"{ours.url}/checkpoints", headers=auth).status_code == 200


def test_bad_requests_get_json_errors_and_leave_the_slot_intact(tiny_model: Any) -> None:
    with run_server(model_args(tiny_model("llama"))) as ours:
        messages = [{"role": "system", "content": SYSTEM[2]}, {"role": "user", "content": "hello"}]
        first = chat(client(ours), messages).choices[0].message.content
        bad = HTTP.post(f"{ours.url}/v1/chat/completions", content=b"{not json",
                         headers={"Content-Type": "application/json"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
        wrong = HTTP.post(f"{ours.url}/v1/chat/completions", json={"messages": "nope"})
        assert wrong.status_code == 422 and "messages" in wrong.json()["error"]["message"]
        not_object = HTTP.post(f"{ours.url}/v1/completions", json=[1, 2])
        assert not_object.status_code == 400
        missing = HTTP.get(f"{ours.url}/no/such/route")
        assert missing.status_code == 404 and missing.json()
        assert chat(client(ours), messages).choices[0].message.content == first


def test_invalid_checkpoints_section_fails_at_start(tiny_model: Any, tmp_path: Any) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "models": [{"model": str(tiny_model("llama"))}],
        "checkpoints": {"cache_max_bytes": "1GiB", "no_such_key": 3},
    }))
    done = subprocess.run([sys.executable, "-m", "ckpt_plugin_integrations.llama_cpp_server", "--config_file",
                           str(config)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "no_such_key" in done.stderr


def test_multi_model_config_keeps_caches_per_model(tiny_model: Any, tmp_path: Any) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "models:\n"
        f"  - model: {tiny_model('llama')}\n    model_alias: plain\n    n_ctx: 2048\n    n_batch: 64\n"
        f"  - model: {tiny_model('gemma3')}\n    model_alias: swa\n    n_ctx: 2048\n    n_batch: 64\n"
        "checkpoints:\n  checkpoint_min_step: 32\n  admin: true\n"
    )
    with run_server(["--config_file", str(config)]) as ours:
        c = client(ours)
        messages = [{"role": "system", "content": SYSTEM[0]}, {"role": "user", "content": "hello"}]
        for alias in ("plain", "swa", "plain", "swa"):
            response = c.chat.completions.create(model=alias, messages=messages, max_tokens=3, temperature=0)
        # the last request is the second one on "swa": warm from its own cache after the model was reloaded
        assert response.usage.prompt_tokens_details.cached_tokens > 50
        view = HTTP.get(f"{ours.url}/checkpoints").json()["models"]
        assert list(view) == ["swa"] and view["swa"]["memory_kind"] == "swa"


def test_draft_model_from_the_command_line(tiny_model: Any) -> None:
    path = tiny_model("llama")
    args = model_args(path) + ["--checkpoint-draft-model", str(path), "--checkpoint-draft-n", "3"]
    with run_server(args) as ours, run_server(model_args(path), plain=True) as plain:
        messages = [{"role": "system", "content": SYSTEM[1]}, {"role": "user", "content": "one two"}]
        mine, theirs = chat(client(ours), messages), chat(client(plain), messages)
        assert mine.choices[0].message.content == theirs.choices[0].message.content


@pytest.mark.parametrize("swa_full", ["false", "true"])
def test_swa_full_setting_reaches_the_model_and_answers_stay_equal(tiny_model: Any, swa_full: str) -> None:
    path = tiny_model("gemma3")
    args = model_args(path) + ["--swa_full", swa_full, "--checkpoint-admin", "true"]
    with run_server(args) as ours, run_server(model_args(path), plain=True) as plain:
        view = HTTP.get(f"{ours.url}/checkpoints").json()["models"]
        assert [m["swa_full"] for m in view.values()] == [swa_full == "true"]
        messages = [{"role": "system", "content": SYSTEM[0]}, {"role": "user", "content": "hello world"}]
        for edit in ("hello world", "and then the dog"):
            messages[-1]["content"] = edit
            mine, theirs = chat(client(ours), messages), chat(client(plain), messages)
            assert mine.choices[0].message.content == theirs.choices[0].message.content


@pytest.mark.gemma
def test_default_model_is_the_embedded_gemma(gemma_path: Any) -> None:
    """No --model: ckpt-serve serves Gemma-3-270M from its PyPI package; turns after the first reuse the prompt."""
    with run_server(["--n_ctx", "2048", "--n_threads", "2"]) as ours:
        models = HTTP.get(f"{ours.url}/v1/models").json()["data"]
        assert "gemma-3-270m" in models[0]["id"]
        results = interleaved([ours], turns=2)[0]
        assert_previous_prompt_reused(results, slack=1)
        assert ours.metric("checkpoints_created_total") > 0
