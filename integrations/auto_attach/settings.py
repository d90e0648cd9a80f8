"""What an auto-attached program is given: ckpt-run's own options and the checkpoint settings of every ``Llama``.

Both come from ``CKPT_*`` environment variables, so that every process of a program (workers, children) reads the
same values: ``ckpt-run`` turns its flags into those variables before it starts the command. Checkpoint settings may
also come from a file (``CKPT_CONFIG_FILE``, JSON, TOML or YAML, the keys of
:class:`~ckpt_plugin.config.CheckpointSettings` at the top level); a variable wins over the file.
"""

from __future__ import annotations

import inspect
import json
import os
from typing import Any, Literal

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

from ckpt_plugin.config import CheckpointSettings
from ckpt_plugin.errors import ConfigError

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
    llama_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Llama constructor arguments that replace what the program passes, as a JSON object "
        '(CKPT_LLAMA_OVERRIDES=\'{"n_batch": 512, "swa_full": false}\').',
    )


def _file_source(settings_cls: type[BaseSettings], path: str) -> PydanticBaseSettingsSource:
    if not os.path.isfile(path):
        raise ConfigError(f"checkpoint settings file {path} not found")
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".json":
        return JsonConfigSettingsSource(settings_cls, json_file=path)
    if suffix == ".toml":
        return TomlConfigSettingsSource(settings_cls, toml_file=path)
    if suffix in (".yaml", ".yml"):
        return YamlConfigSettingsSource(settings_cls, yaml_file=path)
    raise ConfigError(f"checkpoint settings file {path}: use a .json, .toml, .yaml or .yml file")


def load_checkpoint_settings(config_file: str | None = None) -> CheckpointSettings:
    """Checkpoint settings from ``CKPT_*`` variables over ``config_file`` (if given) over the defaults.

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
        raise ConfigError(f"invalid checkpoint settings: {describe_errors(exc)}") from exc
    except SettingsError as exc:  # a file that does not parse
        raise ConfigError(f"invalid checkpoint settings: {exc}") from exc
    return CheckpointSettings(**loaded.model_dump())


def load_run_settings() -> RunSettings:
    """ckpt-run's options from the environment.

    :raises ConfigError: A value is invalid (the message names the variable).
    """
    try:
        return RunSettings()
    except ValidationError as exc:
        raise ConfigError(f"invalid ckpt-run settings: {describe_errors(exc)}") from exc
    except SettingsError as exc:  # a variable that is not valid JSON where JSON is expected
        raise ConfigError(f"invalid ckpt-run settings: {exc}") from exc


def describe_errors(exc: ValidationError) -> str:
    """One line naming each invalid field and why."""
    return "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg']}" for err in exc.errors())


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


def check_llama_overrides(overrides: dict[str, Any], init: Any) -> None:
    """Refuse override names that ``init`` (``Llama.__init__``) has no parameter for.

    :raises ConfigError: Naming the unknown names.
    """
    parameters = {
        name
        for name, parameter in inspect.signature(init).parameters.items()
        if name != "self" and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
    }
    unknown = sorted(set(overrides) - parameters)
    if unknown:
        raise ConfigError(f"llama_cpp.Llama has no parameter {', '.join(unknown)} (llama overrides)")
