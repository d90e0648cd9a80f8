"""ckpt-serve and ckpt-run spell, type and document the checkpoint settings the same way
(ckpt_plugin_integrations/settings_flags.py); ckpt-serve's former ``--checkpoint-*`` names still work."""

from __future__ import annotations

import argparse
import re

import pytest

from ckpt_plugin.core.config import CheckpointSettings, ServeSettings
from ckpt_plugin_integrations.auto_attach import cli as run_cli
from ckpt_plugin_integrations.llama_cpp_server import cli as serve_cli
from ckpt_plugin_integrations.settings_flags import flag_specs, format_size, parse_bool, plain_text

COMMAND = ["--", "python", "app.py"]


def _help(parser: argparse.ArgumentParser) -> str:
    return parser.format_help()


def _entries(text: str) -> dict[str, str]:
    """``--flag METAVAR`` -> its help text (joined lines), for each option of a ``--help`` text."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        match = re.match(r"^  (--[a-z0-9_-]+)(?: (\S+))?(?:\s{2,}(.*))?$", line)
        if match:
            current = f"{match.group(1)} {match.group(2) or ''}".strip()
            entries[current] = match.group(3) or ""
        elif current and line.startswith("   ") and line.strip():
            entries[current] = f"{entries[current]} {line.strip()}".strip()
        else:
            current = None if not line.strip() else current
    return entries


def test_both_parsers_accept_the_canonical_names() -> None:
    args = run_cli.build_parser().parse_args(
        ["--cache-max-bytes", "1GiB", "--max-checkpoints", "8", "--disk-dir", "/tmp/x", "--redis-url",
         "redis://h:6379/0", "--load-entrypoints", "false", *COMMAND])
    assert (args.ckpt_cache_max_bytes, args.ckpt_max_checkpoints, args.ckpt_disk_dir) == ("1GiB", "8", "/tmp/x")
    env = run_cli.child_environment(args, {})
    assert env["CKPT_CACHE_MAX_BYTES"] == "1GiB" and env["CKPT_LOAD_ENTRYPOINTS"] == "false"
    assert env["CKPT_REDIS_URL"] == "redis://h:6379/0"

    args = serve_cli.build_parser().parse_args(
        ["--cache-max-bytes", "1GiB", "--max-checkpoints", "8", "--disk-dir", "/tmp/x", "--namespaces", "api_key",
         "--admin", "yes", "--swa-full", "false", "--max-body-bytes", "1MiB", "--redis-url", "redis://h:6379/0"])
    assert args.ckpt_cache_max_bytes == 1 << 30 and args.ckpt_max_checkpoints == 8
    assert args.ckpt_disk_dir == "/tmp/x" and args.ckpt_namespaces == "api_key" and args.ckpt_admin is True
    assert args.ckpt_swa_full is False and args.ckpt_max_body_bytes == 1 << 20
    assert args.ckpt_redis_url == "redis://h:6379/0"


@pytest.mark.parametrize("alias", list(serve_cli.CHECKPOINT_ALIASES))
def test_ckpt_serve_keeps_its_former_names_as_hidden_aliases(alias: str) -> None:
    field = serve_cli.CHECKPOINT_ALIASES[alias]
    spec = {s.field: s for s in flag_specs(ServeSettings)}[field]
    value = {"SIZE": "3MiB", "N": "3", "SECONDS": "3", "BOOL": "true", "{off,api_key,header}": "header"}.get(
        spec.metavar, "x")
    via_alias = serve_cli.build_parser().parse_args([alias, value])
    via_flag = serve_cli.build_parser().parse_args([spec.flag, value])
    assert getattr(via_alias, f"ckpt_{field}") == getattr(via_flag, f"ckpt_{field}") is not None
    if alias != spec.flag:
        assert alias not in _help(serve_cli.build_parser())


def test_a_bad_value_names_the_flag_as_typed(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, name in ((["--checkpoint-budget", "12XB"], "--checkpoint-budget"),
                       (["--cache-max-bytes", "12XB"], "--cache-max-bytes")):
        with pytest.raises(SystemExit) as exit_info:
            serve_cli.build_parser().parse_args(argv)
        assert exit_info.value.code == 2
        assert capsys.readouterr().err == f"ckpt-serve: {name}: not a byte size: '12XB' " \
            "(use e.g. 2GiB, 512MB or a number of bytes)\n"
    with pytest.raises(SystemExit):
        serve_cli.build_parser().parse_args(["--checkpoint-admin", "maybe"])
    assert capsys.readouterr().err == "ckpt-serve: --checkpoint-admin: expected true or false, got 'maybe'\n"
    with pytest.raises(SystemExit):
        run_cli.build_parser().parse_args(["--load-entrypoints", "maybe", *COMMAND])
    assert capsys.readouterr().err == "ckpt-run: --load-entrypoints: expected true or false, got 'maybe'\n"


def test_a_validation_error_names_the_flag_as_typed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONFIG_FILE", raising=False)
    monkeypatch.setenv("MODEL", "/nonexistent.gguf")
    for flag in ("--checkpoint-per-slot", "--max-checkpoints"):
        with pytest.raises(serve_cli.ConfigError, match=f"^{flag}: Input should be greater than or equal to 0$"):
            serve_cli.load_settings([flag, "-1"])


def test_both_help_texts_list_the_same_flags_defaults_and_units() -> None:
    serve = _entries(_help(serve_cli.build_parser()))
    run = _entries(_help(run_cli.build_parser()))
    for spec in flag_specs(CheckpointSettings):
        key = f"{spec.flag} {spec.metavar}"
        assert key in serve and key in run, key
        assert serve[key] == run[key], key
        assert f"(default: {spec.default}; CKPT_{spec.field.upper()})" in serve[key]
    for spec in flag_specs(ServeSettings):
        assert f"{spec.flag} {spec.metavar}" in serve
    assert "(default: 2GiB;" in serve["--cache-max-bytes SIZE"]
    assert "(default: 10GiB;" in run["--disk-max-bytes SIZE"]
    assert "(default: 32MiB;" in serve["--max-body-bytes SIZE"]
    assert "(default: off;" in serve["--namespaces {off,api_key,header}"]
    assert "--redis-url URL" in run and "--redis-timeout SECONDS" in run and "--max-checkpoints N" in run
    assert "--disk-dir PATH" in run and "--load-entrypoints BOOL" in run and "--slot-save-path PATH" in serve
    # llama_cpp.server's own flags (ckpt-serve only) keep their help as llama_cpp.server writes it.
    serve_checkpoints = _help(serve_cli.build_parser()).split("\ncheckpoint settings", 1)[1]
    for text in (serve_checkpoints, _help(serve_cli.build_parser()).split("\n\n")[1], _help(run_cli.build_parser())):
        assert "`" not in text
        for spec in flag_specs(CheckpointSettings):  # a metavar from the type, not VALUE or the variable's name
            assert f"{spec.flag} VALUE" not in text and f"{spec.flag} CKPT_" not in text
        assert "--checkpoint-budget" not in text


def test_the_shared_parsers() -> None:
    assert [parse_bool(t) for t in ("1", "True", "yes", "on", "0", "false", "NO", "off")] == [True] * 4 + [False] * 4
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bool("maybe")
    assert [format_size(n) for n in (2 << 30, 10 << 30, 32 << 20, 1536, 1000, 0)] == [
        "2GiB", "10GiB", "32MiB", "1536", "1000", "0"]
    assert plain_text("see ``cache_max_bytes`` and :class:`~ckpt_plugin.core.config.CheckpointSettings`, `x`") == (
        "see cache_max_bytes and CheckpointSettings, x")
