"""``ckpt-serve``: ``python -m llama_cpp.server`` with checkpoints.

Takes every ``llama_cpp.server`` setting, spelled as it spells them (``--model``, ``--n_ctx``, ``--host``,
``--port``, ``--config_file``, environment variables such as ``MODEL`` or ``CONFIG_FILE``), plus the checkpoint
settings: ``--<setting>`` flags (``--cache-max-bytes``, as ckpt-run spells them; the former ``--checkpoint-*``
names still work), a ``checkpoints`` section in the JSON/YAML config file, or ``CKPT_*`` environment variables
(flags win over the file, the file over the environment). With no model, it serves the embedded default
(Gemma-3-270M).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import errno
import json
import os
import socket
import sys
from typing import Any, NoReturn, Sequence

from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
from llama_cpp.server.settings import ConfigFileSettings, ModelSettings, ServerSettings, Settings
from pydantic import ValidationError

from ckpt_plugin.config import ServeSettings, setting_variables, unknown_variables
from ckpt_plugin.default_model import default_model_path
from ckpt_plugin.errors import ConfigError
from ckpt_plugin.hosts.llama_cpp.chat_formats import DEFAULT_CHAT_FORMAT

from ..settings_flags import add_settings_flags, flag_name, given_flags, plain_text
from .model_checks import check_chat_formats, check_model_file, templateless_models

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


class _Parser(argparse.ArgumentParser):
    """An argument parser that reports a bad argument in one line: the usage line of ckpt-serve lists every flag
    of llama_cpp.server (dozens of lines), which buried the one that was wrong."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("argument "):
            message = message[len("argument "):]
        if message.startswith("unrecognized arguments: "):
            message += _suggest_flags(message[len("unrecognized arguments: "):].split(), self)
            message += f" ({self.prog} --help lists the options)"
        self.exit(2, f"{self.prog}: {message}\n")


def _suggest_flags(words: list[str], parser: argparse.ArgumentParser) -> str:
    options = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    for word in words:
        if not word.startswith("--"):
            continue
        close = difflib.get_close_matches(word.split("=", 1)[0], options, n=1, cutoff=0.7)
        if close:
            return f"; did you mean {close[0]}?"
    return ""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ckpt-serve", description=plain_text(__doc__.splitlines()[0]))
    add_args_from_model(parser, Settings)
    parser.add_argument("--config_file", type=str, help="Path to a JSON or YAML config file to load.")
    group = parser.add_argument_group("checkpoint settings (also the config file's checkpoints section, CKPT_*)")
    add_settings_flags(group, ServeSettings, aliases=CHECKPOINT_ALIASES)
    return parser


def _read_config_file(path: str, source: str = "--config_file") -> dict[str, Any]:
    where = f"config file {path}"
    if not os.path.exists(path):
        raise ConfigError(f"{source}: no such file: {path}")
    if os.path.isdir(path):
        raise ConfigError(f"{source}: {path} is a directory, not a JSON or YAML file")
    yaml_file = path.endswith((".yaml", ".yml"))
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError as exc:
        raise ConfigError(f"{where}: cannot be read: {exc.strerror or exc}") from None
    if yaml_file:
        import yaml

        try:
            data = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(f"{where} is not valid YAML: {problem}{at}") from None
    else:
        try:
            data = json.loads(raw)
        except UnicodeDecodeError:
            raise ConfigError(f"{where} is not UTF-8 text") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{where} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno} "
                "(a YAML file needs a .yaml or .yml name)"
            ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must hold a mapping at the top level")
    return data


def _problem(err: Any) -> str:
    """Pydantic's message for one error, without its "Value error, " prefix."""
    message = str(err["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        if message.startswith(prefix):
            return message[len(prefix):]
    return message


def _checkpoint_source(
    field: str, flags: dict[str, Any], section: dict[str, Any], config_file: str | None,
    typed: dict[str, str] | None = None,
) -> str:
    """Where the checkpoint setting ``field`` came from: its flag (as typed: canonical or alias), the config file's
    section or its variable."""
    if field in flags:
        return (typed or {}).get(f"ckpt_{field}") or flag_name(field)
    if field in section:
        return f"config file {config_file}: checkpoints.{field}"
    variable = f"CKPT_{field.upper()}"
    if any(name.upper() == variable for name in os.environ):
        return variable
    return field


def _checkpoint_settings(
    section: dict[str, Any], flags: dict[str, Any], config_file: str | None = None,
    typed: dict[str, str] | None = None,
) -> ServeSettings:
    try:
        return ServeSettings(**{**section, **flags})
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = str(err["loc"][0]) if err["loc"] else ""
            if not field:
                problems.append(f"checkpoints: {_problem(err)}")
                continue
            source = _checkpoint_source(field, flags, section, config_file, typed)
            if err["type"] == "extra_forbidden":
                close = difflib.get_close_matches(field, list(ServeSettings.model_fields), n=1)
                problems.append(f"{source}: unknown setting" + (f"; did you mean {close[0]}?" if close else ""))
            else:
                problems.append(f"{source}: {_problem(err)}")
        raise ConfigError("; ".join(problems)) from exc


def _settings_problems(exc: ValidationError, where: str) -> str:
    """One line naming each invalid server or model setting and why."""

    def place(loc: tuple[Any, ...]) -> str:
        return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "settings"

    return f"{where}: " + "; ".join(f"{place(err['loc'])}: {_problem(err)}" for err in exc.errors())


@dataclasses.dataclass
class LoadedSettings:
    """What :func:`load_settings` returns, and where each model's file was named (for messages)."""

    server: ServerSettings
    models: list[ModelSettings]
    checkpoints: ServeSettings
    model_sources: list[str]
    checkpoint_sources: dict[str, str]
    chat_format_sources: list[str]


def load_settings(argv: Sequence[str] | None = None) -> tuple[ServerSettings, list[ModelSettings], ServeSettings]:
    """Server, model and checkpoint settings from the command line, the config file and the environment.

    :raises ConfigError: With a message naming the bad key or flag.
    """
    loaded = _load_settings(argv)
    return loaded.server, loaded.models, loaded.checkpoints


def _load_settings(argv: Sequence[str] | None = None) -> LoadedSettings:
    args = build_parser().parse_args(argv)
    flags = {
        name[len("ckpt_"):]: value
        for name, value in vars(args).items()
        if name.startswith("ckpt_") and value is not None
    }
    config_file = os.environ.get("CONFIG_FILE", args.config_file)
    embedded = False
    try:
        if config_file:
            data = _read_config_file(config_file, "CONFIG_FILE" if os.environ.get("CONFIG_FILE") else "--config_file")
            section = data.pop("checkpoints", None) or {}
            if not isinstance(section, dict):
                raise ConfigError(f"config file {config_file}: the checkpoints section must be a mapping")
            try:
                config = ConfigFileSettings.model_validate_json(json.dumps(data, default=str))
            except ValidationError as exc:
                raise ConfigError(_settings_problems(exc, f"config file {config_file}")) from exc
            # Unlike llama_cpp.server, server flags given on the command line win over the file.
            explicit = {k: v for k, v in vars(args).items() if v is not None and k in ServerSettings.model_fields}
            server = ServerSettings.model_validate(
                {**config.model_dump(include=set(ServerSettings.model_fields)), **explicit}
            )
            models = config.models
            if not models:
                raise ConfigError(f"config file {config_file} names no models")
            sources = [f"config file {config_file}: models[{i}].model" for i in range(len(models))]
            format_sources = [f"config file {config_file}: models[{i}].chat_format" for i in range(len(models))]
        else:
            section = {}
            server = parse_model_from_args(ServerSettings, args)
            if args.model is not None:
                sources = ["--model"]
            elif os.environ.get("MODEL"):
                sources = ["MODEL"]
            else:
                try:
                    args.model = str(default_model_path(progress=True))
                except RuntimeError as exc:  # the package is missing
                    raise ConfigError(f"no --model given, and {exc}") from None
                except OSError as exc:  # the cache directory is not writable, or full
                    raise ConfigError(f"no --model given, and the embedded default model cannot be written to "
                                      f"{exc.filename or 'the cache directory'}: {exc.strerror or exc}") from None
                sources = ["the embedded default model"]
                embedded = True
            models = [parse_model_from_args(ModelSettings, args)]
            format_sources = ["--chat_format" if args.chat_format is not None else "CHAT_FORMAT"]
    except ValidationError as exc:
        raise ConfigError(_settings_problems(exc, "invalid server or model settings")) from exc
    typed = given_flags(args)
    checkpoints = _checkpoint_settings(section, flags, config_file, typed)
    checkpoint_sources = {
        field: _checkpoint_source(field, flags, section, config_file, typed) for field in checkpoints.model_fields_set
    }
    return LoadedSettings(server, [with_serve_defaults(model, embedded) for model in models], checkpoints, sources,
                          checkpoint_sources, format_sources)


def with_serve_defaults(model: ModelSettings, embedded: bool = False) -> ModelSettings:
    """``ckpt-serve``'s model defaults where they differ from ``llama_cpp.server``'s (docs/server.md, "Defaults").

    Flash attention is on unless the flag, the environment or the config file says otherwise, as in llama.cpp's own
    server (``-fa auto``): on CPU it evaluates a 2,000-token Gemma-3 prompt about 1.3x faster.

    :param embedded: ``model`` is the embedded default, served because no model was named: its GGUF has no chat
        template, and it gets :data:`~ckpt_plugin.hosts.llama_cpp.chat_formats.DEFAULT_CHAT_FORMAT` unless a chat format is named
        (docs/server.md, "First run and errors"). A model named by path keeps llama_cpp.server's behaviour.
    """
    update: dict[str, Any] = {}
    if "flash_attn" not in model.model_fields_set:
        update["flash_attn"] = True
    if embedded and "chat_format" not in model.model_fields_set:
        update["chat_format"] = DEFAULT_CHAT_FORMAT
    return model.model_copy(update=update) if update else model


# -------------------------------------------------------------------------------------------------------------------
# Checks before the models load (the model files' own: model_checks.py): each failure is one line on stderr and exit
# status 2.


def check_port(host: str, port: int) -> None:
    """Bind ``host:port`` briefly, as uvicorn will, so that a port in use stops ckpt-serve before a model loads.

    :raises ConfigError: Saying why the address cannot be used.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is no conflict
            sock.bind((host, port))
    except socket.gaierror as exc:
        raise ConfigError(f"--host: cannot listen on {host!r}: {exc.strerror or exc}") from None
    except OverflowError:
        raise ConfigError(f"--port: {port} is not a port number (0-65535)") from None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"--port: {host}:{port} is already in use: stop what listens there or choose another --port"
            ) from None
        if exc.errno == errno.EACCES:
            raise ConfigError(
                f"--port: no permission to listen on {host}:{port} (ports below 1024 need privileges): "
                "choose another --port"
            ) from None
        raise ConfigError(f"--host/--port: cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _address(server: ServerSettings) -> tuple[str, int]:
    host = os.getenv("HOST", server.host)
    try:
        return host, int(os.getenv("PORT", server.port))
    except ValueError:
        raise ConfigError(f"PORT: not a port number: {os.environ.get('PORT')!r}") from None


def known_variables() -> set[str]:
    """Every ``CKPT_*`` variable a ckpt-serve process reads: the checkpoint settings and ckpt-run's."""
    from ckpt_plugin_integrations.auto_attach.settings import RunSettings

    return setting_variables(ServeSettings, RunSettings)


def _fail(message: str) -> NoReturn:
    print(f"ckpt-serve: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv: Sequence[str] | None = None) -> None:
    for warning in unknown_variables(os.environ, known_variables()):
        print(f"ckpt-serve: warning: {warning}", file=sys.stderr)
    try:
        loaded = _load_settings(argv)
        server, models, checkpoints = loaded.server, loaded.models, loaded.checkpoints
        for model, source in zip(models, loaded.model_sources):
            if model.hf_model_repo_id is None:
                check_model_file(model.model, source)
        if checkpoints.draft_model:
            check_model_file(checkpoints.draft_model, loaded.checkpoint_sources.get("draft_model", "draft_model"))
        check_chat_formats(models, loaded.chat_format_sources)
        host, port = _address(server)
        check_port(host, port)
    except ConfigError as exc:
        _fail(str(exc))
    for line in templateless_models(models):
        print(f"ckpt-serve: {line}", file=sys.stderr)
    import uvicorn

    from ckpt_plugin_integrations.auto_attach import uninstall as stop_auto_attach

    from .app import create_app

    # ckpt-serve attaches its models itself (with shared caches per alias): under ckpt-run or CKPT_AUTO_ATTACH=1
    # the models must not be attached a first time as they are created.
    stop_auto_attach()

    try:
        app = create_app(server, models, checkpoints)
    except ConfigError as exc:
        _fail(str(exc))
    except ValueError as exc:  # llama-cpp-python's words for llama.cpp refusing the model or the context
        if str(exc).startswith("Failed to load model from file"):
            _fail(f"llama.cpp could not load {models[0].model}: not a model it supports, or a damaged file "
                  "(its log above says why)")
        if str(exc).startswith("Failed to create llama_context"):
            _fail(f"llama.cpp could not create a context of {models[0].n_ctx} tokens for {models[0].model} "
                  "(its log above says why; a smaller --n_ctx needs less memory)")
        raise
    # sse-starlette ends every stream at once on SIGTERM; streams in flight get shutdown_timeout to finish instead
    # (uvicorn's graceful shutdown cancels what is left after it).
    from sse_starlette.sse import AppStatus

    AppStatus.disable_automatic_graceful_drain()
    uvicorn.run(
        app,
        host=host,
        port=port,
        ssl_keyfile=server.ssl_keyfile,
        ssl_certfile=server.ssl_certfile,
        # Streams in flight get this long to finish on SIGTERM; the lifespan shutdown then parks the slot.
        timeout_graceful_shutdown=checkpoints.shutdown_timeout,
    )


if __name__ == "__main__":
    main()
