"""``ckpt-serve``: ``python -m llama_cpp.server`` with checkpoints.

Takes every ``llama_cpp.server`` setting, spelled as it spells them (``--model``, ``--n_ctx``, ``--host``,
``--port``, ``--config_file``, environment variables such as ``MODEL`` or ``CONFIG_FILE``), plus the checkpoint
settings: ``--checkpoint-*`` flags, a ``checkpoints`` section in the JSON/YAML config file, or ``CKPT_*``
environment variables (flags win over the file, the file over the environment). With no model, it serves the
embedded default (Gemma-3-270M).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import typing
from typing import Any, Sequence

from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
from llama_cpp.server.settings import ConfigFileSettings, ModelSettings, ServerSettings, Settings
from pydantic import ValidationError

from ckpt_plugin.config import ServeSettings, parse_size
from ckpt_plugin.errors import ConfigError
from ckpt_plugin.default_model import default_model_path

CHECKPOINT_FLAGS: dict[str, str] = {
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


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _flag_type(field_name: str) -> dict[str, Any]:
    annotation = ServeSettings.model_fields[field_name].annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    base = args[0]
    if field_name in ("cache_max_bytes", "disk_max_bytes", "max_body_bytes"):
        return {"type": parse_size}
    if field_name in ("admin_key", "redis_url"):
        return {"type": str}
    if typing.get_origin(annotation) is typing.Literal:
        return {"choices": list(typing.get_args(annotation))}
    if base is bool:
        return {"type": _bool}
    return {"type": base if base in (int, float, str) else str}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckpt-serve", description=__doc__.splitlines()[0])
    add_args_from_model(parser, Settings)
    parser.add_argument("--config_file", type=str, help="Path to a JSON or YAML config file to load.")
    group = parser.add_argument_group("checkpoints")
    for flag, field_name in CHECKPOINT_FLAGS.items():
        description = ServeSettings.model_fields[field_name].description
        group.add_argument(flag, dest=f"ckpt_{field_name}", help=description, **_flag_type(field_name))
    return parser


def _read_config_file(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        raise ConfigError(f"config file {path} not found")
    with open(path, "rb") as handle:
        if path.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(handle)
        else:
            data = json.loads(handle.read())
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def _checkpoint_settings(section: dict[str, Any], flags: dict[str, Any]) -> ServeSettings:
    try:
        return ServeSettings(**{**section, **flags})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'checkpoints'}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"invalid checkpoints settings: {problems}") from exc


def load_settings(argv: Sequence[str] | None = None) -> tuple[ServerSettings, list[ModelSettings], ServeSettings]:
    """Server, model and checkpoint settings from the command line, the config file and the environment.

    :raises ConfigError: With a message naming the bad key or flag.
    """
    args = build_parser().parse_args(argv)
    flags = {
        name[len("ckpt_"):]: value
        for name, value in vars(args).items()
        if name.startswith("ckpt_") and value is not None
    }
    config_file = os.environ.get("CONFIG_FILE", args.config_file)
    try:
        if config_file:
            data = _read_config_file(config_file)
            section = data.pop("checkpoints", None) or {}
            if not isinstance(section, dict):
                raise ConfigError("the checkpoints section must be a mapping")
            config = ConfigFileSettings.model_validate_json(json.dumps(data))
            # Unlike llama_cpp.server, server flags given on the command line win over the file.
            explicit = {k: v for k, v in vars(args).items() if v is not None and k in ServerSettings.model_fields}
            server = ServerSettings.model_validate(
                {**config.model_dump(include=set(ServerSettings.model_fields)), **explicit}
            )
            models = config.models
            if not models:
                raise ConfigError(f"config file {config_file} names no models")
        else:
            section = {}
            server = parse_model_from_args(ServerSettings, args)
            if args.model is None and not os.environ.get("MODEL"):
                args.model = str(default_model_path(progress=True))
            models = [parse_model_from_args(ModelSettings, args)]
    except ValidationError as exc:
        raise ConfigError(str(exc)) from exc
    return server, [with_serve_defaults(model) for model in models], _checkpoint_settings(section, flags)


def with_serve_defaults(model: ModelSettings) -> ModelSettings:
    """``ckpt-serve``'s model defaults where they differ from ``llama_cpp.server``'s (docs/server.md, "Defaults").

    Flash attention is on unless the flag, the environment or the config file says otherwise, as in llama.cpp's own
    server (``-fa auto``): on CPU it evaluates a 2,000-token Gemma-3 prompt about 1.3x faster.
    """
    if "flash_attn" not in model.model_fields_set:
        model = model.model_copy(update={"flash_attn": True})
    return model


def main(argv: Sequence[str] | None = None) -> None:
    try:
        server, models, checkpoints = load_settings(argv)
    except ConfigError as exc:
        print(f"ckpt-serve: {exc}", file=sys.stderr)
        sys.exit(2)
    import uvicorn

    from ckpt_plugin_integrations.auto_attach import uninstall as stop_auto_attach

    from .app import create_app

    # ckpt-serve attaches its models itself (with shared caches per alias): under ckpt-run or CKPT_AUTO_ATTACH=1
    # the models must not be attached a first time as they are created.
    stop_auto_attach()

    app = create_app(server, models, checkpoints)
    # sse-starlette ends every stream at once on SIGTERM; streams in flight get shutdown_timeout to finish instead
    # (uvicorn's graceful shutdown cancels what is left after it).
    from sse_starlette.sse import AppStatus

    AppStatus.disable_automatic_graceful_drain()
    uvicorn.run(
        app,
        host=os.getenv("HOST", server.host),
        port=int(os.getenv("PORT", server.port)),
        ssl_keyfile=server.ssl_keyfile,
        ssl_certfile=server.ssl_certfile,
        # Streams in flight get this long to finish on SIGTERM; the lifespan shutdown then parks the slot.
        timeout_graceful_shutdown=checkpoints.shutdown_timeout,
    )


if __name__ == "__main__":
    main()
