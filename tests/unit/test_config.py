"""ckpt-serve settings: the same settings from flags, a config file and the environment."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ckpt_plugin.core.config import CheckpointSettings, parse_size
from ckpt_plugin_integrations.llama_cpp_server.cli import ConfigError, load_settings


def test_flags_file_and_environment_agree(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    from_flags = load_settings([
        "--model", str(model), "--n_ctx", "1024", "--port", "9000",
        "--checkpoint-budget", "1GiB", "--checkpoint-per-slot", "8", "--checkpoint-min-step", "64",
        "--checkpoint-namespaces", "api_key", "--checkpoint-admin", "true",
    ])
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "port": 9000,
        "models": [{"model": str(model), "n_ctx": 1024}],
        "checkpoints": {"cache_max_bytes": "1GiB", "max_checkpoints": 8, "checkpoint_min_step": 64,
                        "namespaces": "api_key", "admin": True},
    }))
    from_file = load_settings(["--config_file", str(config)])
    for name, value in {"MODEL": str(model), "N_CTX": "1024", "PORT": "9000", "CKPT_CACHE_MAX_BYTES": "1GiB",
                        "CKPT_MAX_CHECKPOINTS": "8", "CKPT_CHECKPOINT_MIN_STEP": "64", "CKPT_NAMESPACES": "api_key",
                        "CKPT_ADMIN": "true"}.items():
        monkeypatch.setenv(name, value)
    from_env = load_settings([])
    for server, models, checkpoints in (from_file, from_env):
        assert server.port == from_flags[0].port == 9000
        assert models[0].model == from_flags[1][0].model and models[0].n_ctx == 1024
        assert checkpoints == from_flags[2]
    assert from_flags[2].cache_max_bytes == 1 << 30 and from_flags[2].admin


def test_flags_override_the_file(tmp_path: Any) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("models:\n  - model: x.gguf\ncheckpoints:\n  max_checkpoints: 4\n")
    server, _, checkpoints = load_settings(["--config_file", str(config), "--checkpoint-per-slot", "9",
                                            "--port", "1234"])
    assert checkpoints.max_checkpoints == 9 and server.port == 1234


@pytest.mark.parametrize("section, word", [
    ({"no_such_key": 1}, "no_such_key"),
    ({"max_checkpoints": -1}, "max_checkpoints"),
    ({"cache_max_bytes": "lots"}, "cache_max_bytes"),
    ({"namespaces": "header"}, "namespace_header"),
])
def test_invalid_section_names_the_bad_key(tmp_path: Any, section: dict, word: str) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"models": [{"model": "x.gguf"}], "checkpoints": section}))
    with pytest.raises(ConfigError, match=word):
        load_settings(["--config_file", str(config)])


def test_sizes() -> None:
    assert parse_size("2GiB") == 2 << 30 and parse_size("512 MB") == 512_000_000 and parse_size(7) == 7
    with pytest.raises(ValueError):
        parse_size("12 parsecs")
    with pytest.raises(ValueError):
        CheckpointSettings(cache_max_bytes="-")


def test_flash_attention_is_on_unless_flag_environment_or_file_says_otherwise(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    assert load_settings(["--model", str(model)])[1][0].flash_attn is True
    assert load_settings(["--model", str(model), "--flash_attn", "false"])[1][0].flash_attn is False
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"models": [{"model": str(model), "flash_attn": False}, {"model": str(model)}]}))
    assert [m.flash_attn for m in load_settings(["--config_file", str(config)])[1]] == [False, True]
    monkeypatch.setenv("FLASH_ATTN", "false")
    assert load_settings(["--model", str(model)])[1][0].flash_attn is False


def test_an_explicit_plugin_budget_beats_the_host_cache_size(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/configuration.md, "Precedence": --cache-max-bytes (flag, config key or variable), when given, replaces
    llama_cpp.server's --cache_size; without it, --cache_size keeps its meaning."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    host = ["--model", str(model), "--cache", "true", "--cache_size", "536870912"]
    assert load_settings([*host, "--cache-max-bytes", "1GiB"])[1][0].cache_size == 1 << 30
    assert load_settings([*host, "--checkpoint-budget", "1GiB"])[1][0].cache_size == 1 << 30
    assert load_settings(host)[1][0].cache_size == 536870912
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"models": [{"model": str(model), "cache": True, "cache_size": 536870912}],
                                  "checkpoints": {"cache_max_bytes": "256MiB"}}))
    assert load_settings(["--config_file", str(config)])[1][0].cache_size == 256 << 20
    monkeypatch.setenv("CKPT_CACHE_MAX_BYTES", "128MiB")
    assert load_settings(host)[1][0].cache_size == 128 << 20
    assert load_settings([*host, "--cache-max-bytes", "1GiB"])[1][0].cache_size == 1 << 30  # the flag over its variable
