"""What an auto-attached program is given: ckpt-run's own options and the checkpoint settings of every ``Llama``.

Both come from ``CKPT_*`` environment variables, so that every process of a program (workers, children) reads the
same values: ``ckpt-run`` turns its flags into those variables before it starts the command. Checkpoint settings may
also come from a file (``CKPT_CONFIG_FILE``, JSON, TOML or YAML, the keys of
:class:`~ckpt_plugin.core.config.CheckpointSettings` at the top level); a variable wins over the file.
"""

from __future__ import annotations

import collections.abc
import difflib
import inspect
import json
import os
import types
import typing
from typing import Any, Literal, Mapping

from pydantic import Field, ValidationError
from pydantic_settings import (
    BaseSettings,
    JsonConfigSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)

from ckpt_plugin.core.config import CheckpointSettings
from ckpt_plugin.core.errors import ConfigError

LogLevel = Literal["debug", "info", "warning", "error"]


class RunSettings(BaseSettings):
    """ckpt-run's own options, as ``CKPT_<FIELD>`` variables (``CKPT_AUTO_ATTACH``, ``CKPT_METRICS_PORT``, ...)."""

    model_config = SettingsConfigDict(env_prefix="CKPT_", extra="ignore")

    auto_attach: bool = Field(False, description="Attach every llama_cpp.Llama the program creates.")
    config_file: str | None = Field(
        None, description="JSON, TOML or YAML file of checkpoint settings (CheckpointSettings keys)."
    )
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="Serve Prometheus metrics of the attached Llamas on this port."
    )
    metrics_host: str = Field("127.0.0.1", min_length=1, description="Address the metrics endpoint listens on.")
    log_level: LogLevel | None = Field(
        None, description="Print ckpt_plugin's log records of this level and above to stderr."
    )
    stats_at_exit: bool = Field(
        False, description="Print each attached Llama's reuse summary to stderr when the program ends.")
    llama_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Llama constructor arguments that replace what the program passes, as a JSON object "
        '(CKPT_LLAMA_OVERRIDES=\'{"n_batch": 512, "swa_full": false}\').',
    )


def _file_source(settings_cls: type[BaseSettings], path: str) -> PydanticBaseSettingsSource:
    if not os.path.isfile(path):
        raise ConfigError(f"checkpoint settings file {path} not found")
    suffix = os.path.splitext(path)[1].lower()
    _check_syntax(path, suffix)
    if suffix == ".json":
        return JsonConfigSettingsSource(settings_cls, json_file=path)
    if suffix == ".toml":
        return TomlConfigSettingsSource(settings_cls, toml_file=path)
    if suffix in (".yaml", ".yml"):
        return YamlConfigSettingsSource(settings_cls, yaml_file=path)
    raise ConfigError(f"checkpoint settings file {path}: use a .json, .toml, .yaml or .yml file")


def _check_syntax(path: str, suffix: str) -> None:
    """Refuse a settings file that does not parse, with the file, the problem and where it is, in one line."""
    where = f"checkpoint settings file {path}"
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError as exc:
        raise ConfigError(f"{where} cannot be read: {exc.strerror or exc}") from None
    try:
        if suffix == ".json":
            json.loads(raw)
        elif suffix == ".toml":
            try:
                import tomllib
            except ImportError:  # Python 3.10
                import tomli as tomllib
            tomllib.loads(raw.decode("utf-8"))
        elif suffix in (".yaml", ".yml"):
            import yaml

            try:
                yaml.safe_load(raw)
            except yaml.YAMLError as exc:
                mark = getattr(exc, "problem_mark", None)
                at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
                raise ValueError(f"{getattr(exc, 'problem', None) or exc}{at}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where} is not UTF-8 text") from None
    except ValueError as exc:  # TOML and YAML
        kind = "TOML" if suffix == ".toml" else "YAML"
        raise ConfigError(f"{where} is not valid {kind}: {str(exc).splitlines()[0]}") from None


def load_checkpoint_settings(
    config_file: str | None = None, labels: Mapping[str, str] | None = None
) -> CheckpointSettings:
    """Checkpoint settings from ``CKPT_*`` variables over ``config_file`` (if given) over the defaults.

    :param labels: How messages name a field (``{"cache_max_bytes": "--cache-max-bytes"}``), which then starts
        them; by default a message starts "invalid checkpoint settings:" and names the field.
    :raises ConfigError: The file is missing or of an unknown kind, or a value is invalid (the message names it).
    """
    sources: list[PydanticBaseSettingsSource] = []

    class FileBackedSettings(CheckpointSettings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            # Earlier sources win: a variable (and so a ckpt-run flag) over the file.
            return (init_settings, env_settings, *sources)

    if config_file:
        sources.append(_file_source(FileBackedSettings, config_file))
    try:
        loaded = FileBackedSettings()
    except ValidationError as exc:
        raise ConfigError(_prefixed("invalid checkpoint settings: ", describe_errors(exc, labels), labels)) from exc
    except SettingsError as exc:  # a file that does not parse
        raise ConfigError(f"invalid checkpoint settings: {_settings_error(exc)}") from exc
    return CheckpointSettings(**loaded.model_dump())


def load_run_settings(labels: Mapping[str, str] | None = None) -> RunSettings:
    """ckpt-run's options from the environment.

    :param labels: How messages name a field (``{"metrics_port": "--metrics-port"}``), as for
        :func:`load_checkpoint_settings`.
    :raises ConfigError: A value is invalid (the message names the variable).
    """
    try:
        return RunSettings()
    except ValidationError as exc:
        raise ConfigError(_prefixed("invalid ckpt-run settings: ", describe_errors(exc, labels), labels)) from exc
    except SettingsError as exc:  # a variable that is not valid JSON where JSON is expected
        raise ConfigError(f"invalid ckpt-run settings: {_settings_error(exc)}") from exc


def _prefixed(prefix: str, problems: str, labels: Mapping[str, str] | None) -> str:
    """With labels (ckpt-run's flags and variables) a message starts with the label; without, with ``prefix``."""
    return problems if labels else prefix + problems


def _settings_error(exc: SettingsError) -> str:
    """pydantic-settings' message (``error parsing value for field "x" from source "y"``) and its cause, one line."""
    cause = exc.__cause__ or exc.__context__
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"{text}: {str(cause).splitlines()[0]}" if cause is not None and str(cause) else text


def _problem(err: Any) -> str:
    message = str(err["msg"])
    return message[len("Value error, "):] if message.startswith("Value error, ") else message


def describe_errors(exc: ValidationError, labels: Mapping[str, str] | None = None) -> str:
    """One line naming each invalid field (by its label, if ``labels`` has one) and why."""
    labels = labels or {}
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "settings"
        where = labels.get(str(err["loc"][0]), where) if err["loc"] else where
        problems.append(f"{where}: {'unknown setting' if err['type'] == 'extra_forbidden' else _problem(err)}")
    return "; ".join(problems)


def parse_override(text: str) -> tuple[str, Any]:
    """``"n_batch=512"`` -> ``("n_batch", 512)``: the value is read as JSON (numbers, true/false, null), else text.

    :raises ConfigError: No ``=``, or an empty name.
    """
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise ConfigError(f"--llama takes NAME=VALUE (e.g. n_batch=512), got {text!r}")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    return name.strip(), parsed


def check_llama_overrides(overrides: dict[str, Any], init: Any, labels: Mapping[str, str] | None = None) -> None:
    """Refuse override names that ``init`` (``Llama.__init__``) has no parameter for, and values its annotations
    (or, where one cannot be read, its default's type) refuse.

    :param labels: How messages name an override (``{"n_batch": "--llama n_batch=abc"}``).
    :raises ConfigError: Naming the unknown names, or the override, the type it needs and the value given.
    """
    parameters = {
        name: parameter
        for name, parameter in inspect.signature(init).parameters.items()
        if name != "self" and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
    }
    unknown = sorted(set(overrides) - set(parameters))
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, sorted(parameters), n=1)
        label = (labels or {}).get(name, "llama overrides")
        raise ConfigError(f"{label}: llama_cpp.Llama has no parameter {', '.join(unknown)}"
                          + (f"; did you mean {close[0]}?" if close else ""))
    hints = _type_hints(init)
    for name, value in overrides.items():
        parameter = parameters[name]
        expected = hints.get(name)
        if expected is None and parameter.default not in (inspect.Parameter.empty, None):
            expected = type(parameter.default)
        if expected is None or _accepts(expected, value):
            continue
        label = (labels or {}).get(name, f"llama override {name}")
        default = "" if parameter.default is inspect.Parameter.empty else f" (default {_json(parameter.default)})"
        raise ConfigError(
            f"{label}: llama_cpp.Llama's {name} takes {_describe(expected)}{default}, not {json.dumps(value)}"
        )


def _json(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _type_hints(init: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(init)
    except Exception:  # noqa: BLE001 - an annotation this Python cannot resolve: check what can be resolved
        namespace = vars(inspect.getmodule(init) or typing)
        hints = {}
        for name, annotation in getattr(init, "__annotations__", {}).items():
            try:
                hints[name] = eval(annotation, namespace) if isinstance(annotation, str) else annotation  # noqa: S307
            except Exception:  # noqa: BLE001
                continue
        return hints


def _is_union(expected: Any) -> bool:
    return typing.get_origin(expected) is typing.Union or isinstance(expected, types.UnionType)


def _accepts(expected: Any, value: Any) -> bool:
    """Whether a value read from JSON fits the annotation ``expected`` (constructs it does not know pass)."""
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if expected is Any:
        return True
    if expected is None or expected is type(None):
        return value is None
    if _is_union(expected):
        return any(_accepts(arg, value) for arg in args)
    if origin is Literal:
        return value in args
    if origin in (list, collections.abc.Sequence, tuple):
        return isinstance(value, list) and (not args or all(_accepts(args[0], item) for item in value))
    if origin in (dict, collections.abc.Mapping):
        return isinstance(value, dict) and (
            len(args) != 2 or all(_accepts(args[0], k) and _accepts(args[1], v) for k, v in value.items())
        )
    if expected is bool:
        return isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(expected, type):
        try:
            return isinstance(value, expected)
        except TypeError:  # a Protocol: no JSON value is one
            return False
    if origin is collections.abc.Callable:
        return callable(value)
    return True


def _describe(expected: Any) -> str:
    """``expected`` in words, for a message."""
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if expected is None or expected is type(None):
        return "null"
    if _is_union(expected):
        return " or ".join(dict.fromkeys(_describe(arg) for arg in args))
    if origin is Literal:
        return "one of " + ", ".join(json.dumps(arg) for arg in args)
    if origin in (list, collections.abc.Sequence, tuple):
        plural = {bool: "true/false values", int: "integers", float: "numbers", str: "strings"}
        return f"a list of {plural.get(args[0], 'values')}" if args else "a list"
    if origin in (dict, collections.abc.Mapping):
        return "a JSON object"
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if expected in words:
        return words[expected]
    name = getattr(expected, "__name__", None) or str(expected)
    return f"a {name} object (not something --llama can give)"
