"""Checks of the model files ckpt-serve is asked to serve, before any loads: each refusal is a
:class:`~ckpt_plugin.errors.ConfigError` naming the flag, variable or config key that gave the bad value."""

from __future__ import annotations

import difflib
import logging
import os

import gguf
from llama_cpp.server.settings import ModelSettings

from ckpt_plugin.default_model import is_default_model
from ckpt_plugin.errors import ConfigError
from ckpt_plugin.hosts.llama_cpp.chat_formats import DEFAULT_CHAT_FORMAT, known_chat_formats

log = logging.getLogger("ckpt_plugin")


def check_model_file(path: str, source: str) -> None:
    """Refuse a model path that is missing, a directory or not a GGUF file.

    :raises ConfigError: Naming the flag, variable or config key that gave the path.
    """
    label = f"{source}: " if source else ""
    if not os.path.exists(path):
        raise ConfigError(f"{label}no such file: {path}")
    if os.path.isdir(path):
        raise ConfigError(f"{label}{path} is a directory, not a GGUF model file")
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise ConfigError(f"{label}cannot read {path}: {exc.strerror or exc}") from None
    if magic != b"GGUF":
        raise ConfigError(f"{label}{path} is not a GGUF model file")


def gguf_strings(path: str, keys: set[str]) -> dict[str, str] | None:
    """The string values of ``keys`` in a GGUF file's metadata (absent keys are left out), read with the ``gguf``
    package (llama.cpp's own reader) without loading the model; None if the file cannot be read."""
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as exc:
        log.debug("could not read the metadata of %s: %s", path, exc)
        return None
    found = {}
    for key in keys:
        field = reader.get_field(key)
        if field is not None and field.types == [gguf.GGUFValueType.STRING]:
            found[key] = bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    return found


def templateless_models(models: list[ModelSettings]) -> list[str]:
    """One line for each model that has no chat template and no chat format: its chat requests use llama-cpp-python's
    fallback, the llama-2 format, which models of other families answer with nonsense."""
    lines = []
    for model in models:
        if model.chat_format is not None or model.hf_model_repo_id is not None:
            continue
        metadata = gguf_strings(model.model, {"tokenizer.chat_template", "general.architecture"})
        if metadata is None or "tokenizer.chat_template" in metadata:
            continue
        examples = {"gemma3": "gemma3", "gemma": "gemma", "gemma2": "gemma"}.get(
            metadata.get("general.architecture", ""), "chatml, llama-3, mistral-instruct, gemma3"
        )
        if is_default_model(model.model):  # the pretrained Gemma-3-270M: its turns are untrained
            examples = f"{DEFAULT_CHAT_FORMAT}, which ckpt-serve gives it when no --model is named"
        lines.append(
            f"model {model.model_alias or model.model} has no chat template; chat requests use the llama-2 format: "
            f"set --chat_format (e.g. {examples}) or chat_format in the config file"
        )
    return lines


def check_chat_formats(models: list[ModelSettings], sources: list[str]) -> None:
    """Refuse a chat format no handler has (llama_cpp.server would answer every chat request with a 500).

    :raises ConfigError: Naming the format, the closest known one and where it was set.
    """
    known = known_chat_formats()
    for model, source in zip(models, sources):
        name = model.chat_format
        if name is None or name in known or name.startswith("chat_template."):  # the GGUF's named templates
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else f"known formats: {', '.join(sorted(known))}"
        raise ConfigError(f"{source}: unknown chat format {name!r}; {hint}")
