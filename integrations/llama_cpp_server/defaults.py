"""ckpt-serve's defaults where they differ from llama_cpp.server's (docs/server.md, "Defaults"), the one precedence
rule between a checkpoint setting and a host setting, and the embedded default model served when none is named.

They apply after the flags, the environment and the config file are read (``settings.py``), to what none of them set.
"""

from __future__ import annotations

from typing import Any, Collection

from llama_cpp.server.settings import ModelSettings, ServerSettings

from ckpt_plugin.core.config import ServeSettings
from ckpt_plugin.core.errors import ConfigError
from ckpt_plugin.hosts.llama_cpp.serving.chat_formats import DEFAULT_CHAT_FORMAT
from ckpt_plugin.hosts.llama_cpp.serving.default_model import (
    default_model_location,
    default_model_path,
    is_default_model,
)

__all__ = ["embedded_model", "with_plugin_precedence", "with_serve_defaults", "with_serve_server_defaults"]


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
        template, and it gets :data:`~ckpt_plugin.hosts.llama_cpp.serving.chat_formats.DEFAULT_CHAT_FORMAT` unless a
        chat format is named (docs/server.md, "First run and errors"), and so does the same file named by path
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


def embedded_model(assemble: bool) -> str:
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
