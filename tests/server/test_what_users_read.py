"""What a user of ckpt-serve reads: the start-up line and a quiet log, ``--help``, ``/metrics`` and
``/checkpoints/stats`` after a real chat, the settings precedence, one-line refusals of a budget too small and of a
truncated model, counters per model across model switches, and the own-app example of docs/server.md: real servers
on 127.0.0.1, real clients, tiny models."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import re
import subprocess
import sys
from typing import Any, Callable, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.servers import Server, free_port, serving

ROOT = pathlib.Path(__file__).resolve().parents[2]
SERVER_MD = ROOT / "docs" / "server.md"
SERVE = [sys.executable, "-m", "ckpt_plugin_integrations.llama_cpp_server"]
TINY = ["--n_ctx", "2048", "--n_batch", "64", "--n_ubatch", "64", "--n_threads", "2", "--seed", "0"]
TURNS = ["Tell me about rivers.", "And the sea?", "Name one lake.", "Thanks, and a mountain?"]


def ready(port: int) -> Callable[[], bool]:
    return lambda: httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200


@pytest.fixture(scope="module")
def chatted(tiny_model: Callable[[str], pathlib.Path]) -> Iterator[tuple[Server, list[str]]]:
    """ckpt-serve as a user starts it (no --verbose), with the host's cache flags and the plugin's budget flag,
    after a 4-turn chat through the official client; and its output up to the first request."""
    import openai

    port = free_port()
    command = [*SERVE, "--host", "127.0.0.1", "--port", str(port), "--model", str(tiny_model("llama")), *TINY,
               "--admin", "true", "--cache", "true", "--cache_size", "536870912", "--cache-max-bytes", "1GiB"]
    with serving(command, ready(port)) as (process, log):
        started = list(log)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        messages: list[dict[str, str]] = [{"role": "system", "content": "You answer about places. " * 8}]
        for turn in TURNS:
            messages.append({"role": "user", "content": turn})
            reply = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content or "x"})
        yield Server(process, port, log), started


def test_one_start_up_line_says_what_is_served_and_llama_cpp_is_quiet(
    chatted: tuple[Server, list[str]], tiny_model: Callable[[str], pathlib.Path]
) -> None:
    server, started = chatted
    lines = [line for line in started if line.startswith("ckpt-serve: serving ")]
    assert len(lines) == 1, started
    line = lines[0]
    for part in (f"serving {tiny_model('llama')} at http://127.0.0.1:{server.port}/v1",
                 "chat format the GGUF's chat template", "1 slot of n_ctx 2048",
                 # --cache-max-bytes, given, wins over the host's --cache_size (configuration.md, "Precedence")
                 "state budget 1GiB", "tiers ram", "admin routes on (/checkpoints, /checkpoints/stats)",
                 "metrics /metrics", "slot files off"):
        assert part in line, (part, line)
    # llama.cpp's load log (print_info, llama_model_loader, ...: over a hundred lines) stays off without --verbose.
    assert not [text for text in started if text.startswith(("llama_model_loader", "print_info", "load_tensors"))]
    assert len(started) < 12, started


def test_verbose_true_brings_the_llama_cpp_log_back(tiny_model: Callable[[str], pathlib.Path]) -> None:
    done = subprocess.run([*SERVE, "--model", str(tiny_model("llama")), *TINY, "--verbose", "true",
                           "--cache-max-bytes", "1000", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "print_info" in done.stderr and "llama_model_loader" in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("ckpt-serve: --cache-max-bytes: a state budget of 1,000")


def families(text: str) -> list[Any]:
    return list(text_string_to_metric_families(text))


def test_metrics_parse_with_each_family_once_and_reuse_as_the_headline(chatted: tuple[Server, list[str]]) -> None:
    server, _ = chatted
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    parsed = families(text)
    names = collections.Counter(family.name for family in parsed)
    assert [name for name, count in names.items() if count > 1] == []
    by_name = {family.name: family for family in parsed}
    helps = {family.name: family.documentation for family in parsed}
    assert not [name for name, doc in helps.items() if "--checkpoint-" in doc]
    assert "--cache-max-bytes" in helps["ckpt_state_budget_bytes"]

    def value(name: str, **labels: str) -> float:
        return sum(s.value for s in by_name[name].samples
                   if s.name.endswith("_total" if by_name[name].type == "counter" else "") and
                   all(s.labels.get(k) == v for k, v in labels.items()))

    reused = {source: value("ckpt_prompt_tokens_reused", source=source) for source in ("slot", "cache", "disk", "shared")}
    assert reused["slot"] > 0  # turns 2-4 continue the conversation the slot holds
    assert sum(reused.values()) == value("ckpt_tokens_reused")
    assert value("ckpt_prompts") == len(TURNS)
    assert 0 < value("ckpt_tokens_reused") < value("ckpt_prompt_tokens")
    assert value("ckpt_state_budget_bytes") == 1 << 30  # the plugin's flag over --cache_size
    assert value("ckpt_plugin_loaded", plugin="ckpt_plugin.default") == 1
    # The slot gauge is one family, labelled by slot (its sum is the model's).
    assert {s.labels["slot"] for s in by_name["ckpt_slot_checkpoints"].samples} == {"0"}


def documented_stats_fields() -> set[str]:
    """The fields the table of docs/server.md, "Stats fields", names (a row may name several)."""
    text = SERVER_MD.read_text()
    section = text[text.index("### Stats fields"):text.index("## Namespaces")]
    fields: set[str] = set()
    for row in section.splitlines():
        if row.startswith("| `"):
            fields.update(re.findall(r"`([a-z_.]+)`", row.split(" | ")[0]))
    return fields


def test_every_stats_field_is_in_the_docs_table(chatted: tuple[Server, list[str]]) -> None:
    server, _ = chatted
    stats = httpx.get(f"{server.url}/checkpoints/stats", timeout=10).json()["models"]
    (model,) = stats.values()
    served = {*model, *(f"costs.{key}" for key in model["costs"])}
    documented = documented_stats_fields()
    assert served - documented == set()
    assert documented - served == set()  # no row for a field that no longer exists
    assert model["loaded"] is True and model["plugins"] == ["ckpt_plugin.default", "ckpt_plugin.http.metrics"]


def test_disabled_admin_routes_name_the_flag(chatted: tuple[Server, list[str]], tiny_model: Any) -> None:
    port = free_port()
    with serving([*SERVE, "--host", "127.0.0.1", "--port", str(port), "--model", str(tiny_model("llama")), *TINY],
                 ready(port)):
        response = httpx.get(f"http://127.0.0.1:{port}/checkpoints/stats", timeout=10)
    assert response.status_code == 404 and "--admin true" in response.json()["error"]["message"]


def test_help_names_the_built_in_model_and_tells_host_flags_from_plugin_flags() -> None:
    text = subprocess.run([*SERVE, "--help"], capture_output=True, text=True, timeout=60, check=True).stdout
    host_part = text[text.index("\nllama_cpp.server flags ("):text.index("\ncheckpoint settings (")]
    plugin_part = text[text.index("\ncheckpoint settings ("):]
    host, plugin = (set(re.findall(r"^  (--[a-z_-]+)", part, re.M)) for part in (host_part, plugin_part))
    assert "built-in model, Gemma-3-270M" in text
    assert {"--model", "--draft_model", "--cache_size", "--verbose"} <= host
    assert {"--draft-model", "--cache-max-bytes", "--admin"} <= plugin
    assert host & plugin == set() and all("_" not in flag for flag in plugin)
    assert len(text.split("\n\n")[0].splitlines()) == 1  # the usage line, not ~90 flags


def test_a_budget_too_small_for_one_entry_is_one_line_and_exit_2(tiny_model: Callable[[str], pathlib.Path]) -> None:
    done = subprocess.run([*SERVE, "--model", str(tiny_model("llama")), *TINY, "--cache-max-bytes", "1000",
                           "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"ckpt-serve: --cache-max-bytes: a state budget of 1,000 bytes cannot hold one prompt-cache entry of "
        f"{tiny_model('llama')} (at least 8,192 bytes: 32 tokens of its KV cache), so nothing would be reused; give "
        "at least 8KiB, e.g. 1GiB, or 0 to turn reuse off"
    ]


def test_a_truncated_gguf_is_one_line_and_exit_2(tiny_model: Callable[[str], pathlib.Path],
                                                 tmp_path: pathlib.Path) -> None:
    data = tiny_model("llama").read_bytes()
    for cut in (100, len(data) // 2):
        truncated = tmp_path / f"cut{cut}.gguf"
        truncated.write_bytes(data[:cut])
        done = subprocess.run([*SERVE, "--model", str(truncated)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2
        assert done.stderr.splitlines() == [
            f"ckpt-serve: llama.cpp could not load {truncated}: not a model it supports, or a truncated or damaged "
            "file (--verbose true shows llama.cpp's log, which says why)"
        ]


def test_counters_per_model_are_kept_across_model_switches(tiny_model: Callable[[str], pathlib.Path],
                                                           tmp_path: pathlib.Path) -> None:
    config = tmp_path / "two.json"
    config.write_text(json.dumps({"models": [
        {"model": str(tiny_model("gemma3")), "model_alias": "g", "n_ctx": 1024, "chat_format": "chatml"},
        {"model": str(tiny_model("llama")), "model_alias": "l", "n_ctx": 1024},
    ]}))
    port = free_port()
    command = [*SERVE, "--host", "127.0.0.1", "--port", str(port), "--config_file", str(config), "--admin", "true"]
    first = [{"role": "user", "content": "Tell me everything about the rivers of Europe, please. " * 4}]

    def chat(model: str, messages: list[dict[str, str]]) -> dict[str, Any]:
        body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0}
        return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120).json()

    with serving(command, ready(port)) as (_, log):
        startup = [line for line in log if line.startswith("ckpt-serve: serving")]
        reply = chat("g", first)
        chat("l", first)
        back = chat("g", [*first, reply["choices"][0]["message"], {"role": "user", "content": "And lakes?"}])
        stats = httpx.get(f"http://127.0.0.1:{port}/checkpoints/stats", timeout=10).json()["models"]
        metrics = {(s.name, s.labels.get("model")): s.value
                   for family in families(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
                   for s in family.samples}
    assert startup and "serving g (" in startup[0] and "(loaded), l (" in startup[0]
    # Switching back is warm: the conversation was parked in g's cache before the switch.
    assert back["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert set(stats) == {"g", "l"}
    assert (stats["g"]["loaded"], stats["l"]["loaded"]) == (True, False)
    assert (stats["g"]["prompts"], stats["l"]["prompts"]) == (2, 1)  # g's first prompt counted before the switch
    assert stats["g"]["tokens_reused_from_cache"] > 0
    assert metrics[("ckpt_prompts_total", "g")] == 2 and metrics[("ckpt_prompts_total", "l")] == 1


OWN_APP_QUESTION = "Name a river in France."


def own_app_block() -> str:
    text = SERVER_MD.read_text()
    section = text[text.index("## The middleware in your own app"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


@pytest.mark.gemma
def test_the_own_app_example_serves_the_built_in_model_with_its_chat_format(tmp_path: pathlib.Path) -> None:
    (tmp_path / "app.py").write_text(own_app_block())
    port = free_port()
    command = [sys.executable, "-m", "uvicorn", "app:app", "--host", "127.0.0.1", "--port", str(port)]

    def up() -> bool:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).status_code == 200

    with serving(command, up, cwd=tmp_path, env={"PYTHONPATH": os.pathsep.join(sys.path)}):
        url = f"http://127.0.0.1:{port}"
        messages = [{"role": "user", "content": OWN_APP_QUESTION}]
        first = httpx.post(f"{url}/chat", json={"messages": messages}, timeout=120).json()["reply"]
        messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "And in Italy?"}]
        httpx.post(f"{url}/chat", json={"messages": messages}, timeout=120).raise_for_status()
        stats = httpx.get(f"{url}/checkpoints/stats", timeout=10).json()["models"]["gemma-3-270m"]
    # The transcript format, not llama-2's: an answer, not the prompt's markup echoed.
    assert first.strip() and "[INST]" not in first and "<s>" not in first and "User:" not in first
    assert stats["tokens_reused_from_slot"] > 0
