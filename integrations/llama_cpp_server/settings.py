"""ckpt-serve's settings, read in layers. A checkpoint setting's flag wins over the config file's ``checkpoints``
section, the section over its ``CKPT_*`` variable. A llama_cpp.server setting's flag wins over the config file
(``--config_file`` or ``CONFIG_FILE``) where one is named, else over its variable (``MODEL``, ``N_CTX``, ...). What
none of them sets gets ckpt-serve's defaults where they differ from llama_cpp.server's (``defaults.py``).

Each refusal is a :class:`~ckpt_plugin.core.errors.ConfigError` that names where the bad value was given: the flag as
typed, the config file's key or the variable. :class:`LoadedSettings` keeps those sources for the later checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
from typing import Any, Collection, Sequence

from llama_cpp.server.cli import parse_model_from_args
from llama_cpp.server.settings import ConfigFileSettings, ModelSettings, ServerSettings, Settings
from pydantic import ValidationError

from ckpt_plugin.core.config import ServeSettings
from ckpt_plugin.core.errors import ConfigError

from ckpt_plugin_integrations.llama_cpp_server.defaults import (
    embedded_model,
    with_plugin_precedence,
    with_serve_defaults,
    with_serve_server_defaults,
)
from ckpt_plugin_integrations.llama_cpp_server.flags import build_parser
from ckpt_plugin_integrations.settings_flags import flag_name, given_flags

__all__ = ["LoadedSettings", "load_settings", "prepare_default_model", "read_settings"]


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
    loaded = read_settings(argv)
    prepare_default_model(loaded)
    return loaded.server, loaded.models, loaded.checkpoints


def read_settings(argv: Sequence[str] | None = None) -> LoadedSettings:
    """The settings of every layer, merged, with where each came from; the embedded default model, where it is
    served, named by the path its file will have (:func:`prepare_default_model` writes it).

    :raises ConfigError: With a message naming the bad key, flag or variable.
    :raises SystemExit: With status 2, a flag or value the parser refuses (one line on stderr).
    """
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
                args.model = embedded_model(assemble=False)
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


def prepare_default_model(loaded: LoadedSettings) -> None:
    """Assemble the embedded default model's file where it is served and missing (the first run: 270 MB written to
    ``~/.cache``, with a progress bar on stderr); :func:`~.cli.main` calls it after every check, so that a bad argument
    is reported at once, not after the model is written.

    :raises ConfigError: As :func:`~.defaults.embedded_model`.
    """
    if loaded.embedded:
        embedded_model(assemble=True)

