"""Auto-attach inside one process (``ckpt_plugin_integrations.auto_attach.install``), its settings and ckpt-run's
command line; the subprocess paths (ckpt-run, CKPT_AUTO_ATTACH=1) are in test_ckpt_run.py."""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
from typing import Any, Callable, Iterator

import httpx
import pytest
from llama_cpp import Llama

import ckpt_plugin
from ckpt_plugin import ConfigError
from ckpt_plugin_integrations import auto_attach
from ckpt_plugin_integrations.auto_attach.cli import BOOT_DIR, build_parser, child_environment
from ckpt_plugin_integrations.auto_attach.settings import load_checkpoint_settings, load_run_settings, parse_override

TINY = dict(n_ctx=256, n_threads=2, verbose=False)


@pytest.fixture
def llama_path(tiny_model: Callable[[str], pathlib.Path]) -> str:
    return str(tiny_model("llama"))


@pytest.fixture
def installed() -> Iterator[Callable[..., auto_attach.AutoAttacher]]:
    """``installed(**settings)``: auto-attach on for this test."""
    yield lambda **kwargs: auto_attach.install(load_entrypoints=False, **kwargs)
    auto_attach.uninstall()


def test_every_llama_created_is_attached_with_the_settings(installed: Any, llama_path: str) -> None:
    installed(cache_max_bytes="64MiB", llama_overrides={"n_batch": 32})
    first, second = Llama(llama_path, **TINY), Llama(model_path=llama_path, n_batch=256, **TINY)
    managers = auto_attach.managers()
    assert list(managers) == ["llama.gguf", "llama.gguf#2"]
    assert managers["llama.gguf"] is ckpt_plugin.manager_of(first)
    assert managers["llama.gguf"].settings.cache_max_bytes == 64 << 20
    assert (first.n_batch, second.n_batch) == (32, 32)  # the override wins over what the program passes
    # Llamas of one model file share one prompt cache: a new Llama finds what an earlier one left.
    assert managers["llama.gguf"].cache is managers["llama.gguf#2"].cache
    first.create_completion([1, *range(3, 80)], max_tokens=2, temperature=0)
    assert managers["llama.gguf"].stats()["tokens_evaluated"] > 0

    assert ckpt_plugin.detach(first) is managers["llama.gguf"]
    assert list(auto_attach.managers()) == ["llama.gguf#2"]
    third = Llama(llama_path, **TINY)
    # a detached Llama's label is free again
    assert ckpt_plugin.manager_of(third) is auto_attach.managers()["llama.gguf"]
    auto_attach.uninstall()
    assert ckpt_plugin.manager_of(Llama(llama_path, **TINY)) is None


def test_embedding_and_vocab_only_models_are_skipped_with_a_debug_log(
    installed: Any, llama_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    installed()
    with caplog.at_level(logging.DEBUG, logger="ckpt_plugin.auto_attach"):
        embedding = Llama(llama_path, embedding=True, **TINY)
        vocab = Llama(llama_path, vocab_only=True, verbose=False)
    assert ckpt_plugin.manager_of(embedding) is None and ckpt_plugin.manager_of(vocab) is None
    skipped = [r for r in caplog.records if r.getMessage().startswith("not attaching")]
    assert [r.levelno for r in skipped] == [logging.DEBUG, logging.DEBUG]
    assert "embedding" in skipped[0].getMessage() and "vocab_only" in skipped[1].getMessage()
    assert auto_attach.managers() == {}


def test_metrics_endpoint_serves_the_attached_managers(installed: Any, llama_path: str) -> None:
    attacher = installed(metrics_port=0)
    assert not attacher.metrics.started  # no port before a model is loaded
    llama = Llama(llama_path, **TINY)
    llama.create_completion([1, *range(3, 40)], max_tokens=2, temperature=0)
    text = httpx.get(f"http://127.0.0.1:{attacher.metrics.port}/metrics", timeout=10).text
    evaluated = ckpt_plugin.manager_of(llama).stats()["tokens_evaluated"]
    assert f'ckpt_tokens_evaluated_total{{model="llama.gguf"}} {float(evaluated)}' in text


def test_bad_llama_overrides_are_refused(installed: Any) -> None:
    with pytest.raises(ConfigError, match="no parameter n_bacth"):
        installed(llama_overrides={"n_bacth": 8})


def test_checkpoint_settings_from_a_file_under_the_environment(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "ckpt.toml").write_text('cache_max_bytes = "1GiB"\nmax_checkpoints = 8\n')
    (tmp_path / "ckpt.json").write_text('{"cache_max_tokens": 5000}')
    (tmp_path / "ckpt.yaml").write_text("namespace: batch\n")
    monkeypatch.setenv("CKPT_MAX_CHECKPOINTS", "4")
    settings = load_checkpoint_settings(str(tmp_path / "ckpt.toml"))
    assert (settings.cache_max_bytes, settings.max_checkpoints) == (1 << 30, 4)  # the variable wins over the file
    assert load_checkpoint_settings(str(tmp_path / "ckpt.json")).cache_max_tokens == 5000
    assert load_checkpoint_settings(str(tmp_path / "ckpt.yaml")).namespace == "batch"
    (tmp_path / "bad.json").write_text('{"cache_max_byte": 1}')
    with pytest.raises(ConfigError, match="cache_max_byte"):
        load_checkpoint_settings(str(tmp_path / "bad.json"))
    with pytest.raises(ConfigError, match="not found"):
        load_checkpoint_settings(str(tmp_path / "missing.json"))
    (tmp_path / "ckpt.ini").write_text("")
    with pytest.raises(ConfigError, match=r"\.json, \.toml"):
        load_checkpoint_settings(str(tmp_path / "ckpt.ini"))
    monkeypatch.setenv("CKPT_METRICS_PORT", "http")
    with pytest.raises(ConfigError, match="metrics_port"):
        load_run_settings()


def test_ckpt_run_turns_its_options_into_variables_for_the_command() -> None:
    args = build_parser().parse_args(
        ["--cache-max-bytes", "1GiB", "--metrics-port", "9464", "--llama", "n_batch=512", "--llama",
         "swa_full=false", "--", "python", "app.py", "--port", "8000"]
    )
    env = child_environment(args, {"PYTHONPATH": "/app", "CKPT_LLAMA_OVERRIDES": '{"n_ctx": 4096}'})
    assert args.command == ["--", "python", "app.py", "--port", "8000"]
    assert env["CKPT_AUTO_ATTACH"] == "1" and env["CKPT_CACHE_MAX_BYTES"] == "1GiB"
    assert env["CKPT_METRICS_PORT"] == "9464"
    assert env["CKPT_LLAMA_OVERRIDES"] == '{"n_ctx": 4096, "n_batch": 512, "swa_full": false}'
    assert env["PYTHONPATH"] == os.pathsep.join([str(BOOT_DIR), "/app"])
    assert (BOOT_DIR / "sitecustomize.py").is_file()
    assert parse_override("n_gpu_layers=-1") == ("n_gpu_layers", -1)
    assert parse_override("lora_path=/x.gguf") == ("lora_path", "/x.gguf")
    with pytest.raises(ConfigError, match="NAME=VALUE"):
        parse_override("n_batch")
    assert isinstance(args, argparse.Namespace)


def test_a_multi_model_llama_cpp_server_reuses_across_model_switches(
    installed: Any, tiny_model: Callable[[str], pathlib.Path]
) -> None:
    """``ckpt-run -- python -m llama_cpp.server --config_file ...`` in one process: the server closes a model to
    load another; the live conversation goes into the model file's cache first, so switching back is warm."""
    from llama_cpp.server.model import LlamaProxy
    from llama_cpp.server.settings import ModelSettings

    installed()
    proxy = LlamaProxy([ModelSettings(model=str(tiny_model(kind)), model_alias=kind, n_ctx=512, n_threads=2,
                                      verbose=False) for kind in ("gemma3", "llama")])
    prompt = "the river runs to the sea " * 12
    proxy("gemma3").create_completion(prompt, max_tokens=4)
    proxy("llama").create_completion(prompt, max_tokens=4)
    back = proxy("gemma3")
    back.create_completion(prompt + "and back", max_tokens=4)
    assert ckpt_plugin.manager_of(back).stats()["tokens_reused_from_cache"] > 0
    proxy.free()
