"""Checks of the models and files ckpt-serve is asked to serve, before any loads: each refusal is a
:class:`~ckpt_plugin.core.errors.ConfigError` naming the flag, variable or config key that gave the bad value.

llama_cpp.server reads several settings only when it loads a model, and a bad one then stops it with a traceback
(a ``--kv_overrides`` without ``=``, a multimodal chat format without ``--clip_model_path``, a missing LoRA file):
they are checked here first, so that a user learns of them at once rather than after the model has loaded.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import json
import logging
import os
from typing import Callable

import gguf
from llama_cpp.server.settings import ModelSettings

from ckpt_plugin.hosts.llama_cpp.serving.default_model import is_default_model
from ckpt_plugin.core.errors import ConfigError
from ckpt_plugin.hosts.llama_cpp.seam.compat import SERVER_CHAT_FORMATS
from ckpt_plugin.hosts.llama_cpp.serving.chat_formats import DEFAULT_CHAT_FORMAT, TRANSCRIPT_FORMAT, known_chat_formats

log = logging.getLogger("ckpt_plugin")


def check_model_file(path: str, source: str) -> None:
    """Refuse a model path that is missing, a directory or not a GGUF file. (A truncated or damaged GGUF file is
    refused by llama.cpp as it loads, which stops ckpt-serve with one line too: reading it here with ``gguf``'s
    reader would take seconds for a large vocabulary.)

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
    package (llama.cpp's own reader) without loading the model; None if the file cannot be read (missing,
    truncated, damaged: llama.cpp says so when it loads it)."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    strings = _gguf_scalar_strings(path, stat.st_mtime_ns, stat.st_size)
    return None if strings is None else {key: strings[key] for key in keys if key in strings}


@functools.lru_cache(maxsize=8)
def _gguf_scalar_strings(path: str, mtime_ns: int, size: int) -> dict[str, str] | None:
    # Cached per file version: the reader parses every field (seconds for a vocabulary of 262k tokens), and the
    # start-up checks and the start-up line each ask.
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - a truncated file fails with IndexError, ValueError, ... from numpy
        log.debug("could not read the metadata of %s: %s", path, exc)
        return None
    return {name: bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
            for name, field in reader.fields.items() if field.types == [gguf.GGUFValueType.STRING]}


def templateless_models(models: list[ModelSettings]) -> list[str]:
    """One line for each model, as named (before ckpt-serve's defaults), whose chat format is a guess: its GGUF has
    no chat template and no chat format is named. The embedded model's file (wherever it lies) gets ckpt-serve's
    :data:`~ckpt_plugin.hosts.llama_cpp.serving.chat_formats.DEFAULT_CHAT_FORMAT`; any other, llama-cpp-python's
    fallback, the llama-2 format, which models of other families answer with nonsense. Each line says how to choose
    one."""
    lines = []
    for model in models:
        if model.chat_format is not None or model.hf_model_repo_id is not None:
            continue
        name = model.model_alias or model.model
        if is_default_model(model.model):  # the pretrained Gemma-3-270M (no template; its file may not exist yet)
            lines.append(
                f"model {name} has no chat template; chat requests use {DEFAULT_CHAT_FORMAT}, ckpt-serve's format for "
                f"the built-in Gemma-3-270M: set --chat_format (e.g. {TRANSCRIPT_FORMAT}, without its example "
                "exchanges) or chat_format in the config file to choose another"
            )
            continue
        metadata = gguf_strings(model.model, {"tokenizer.chat_template", "general.architecture"})
        if metadata is None or "tokenizer.chat_template" in metadata:
            continue
        examples = {"gemma3": "gemma3", "gemma": "gemma", "gemma2": "gemma"}.get(
            metadata.get("general.architecture", ""), "chatml, llama-3, mistral-instruct, gemma3"
        )
        lines.append(
            f"model {name} has no chat template; chat requests use the llama-2 format: "
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


def check_parallel(models: list[ModelSettings], parallel: int, parallel_source: str = "parallel",
                   draft_sources: list[str] | None = None, draft_model: str | None = None) -> None:
    """Refuse what parallel slots do not serve, before a model loads: several models, two ways of drafting at once
    (llama_cpp.server's ``--draft_model``, prompt lookup decoding, with ckpt-serve's ``--draft-model``), or a
    multimodal projector with either way of drafting (a slot's draft would be handed an image's positions as tokens;
    one slot serves that pair as the host alone does, without reusing images).

    :param parallel_source: Where ``parallel`` was set (a flag, variable or config key).
    :param draft_sources: Where each model's ``draft_model`` was set.
    :param draft_model: ckpt-serve's draft model file, if any.
    :raises ConfigError: Naming the settings that do not go together.
    """
    if parallel <= 1:
        return
    if len(models) > 1:
        raise ConfigError(f"{parallel_source}: parallel > 1 serves one model, and {len(models)} are named "
                          "(use one ckpt-serve per model)")
    for model, source in zip(models, draft_sources or ["draft_model"] * len(models)):
        if model.draft_model is not None and draft_model is not None:
            raise ConfigError(f"{source} with draft-model: a slot drafts with one of them (prompt lookup decoding, "
                              "or the draft model); choose one")
        if model.clip_model_path and (model.draft_model is not None or draft_model is not None):
            which = source if model.draft_model is not None else "draft-model"
            raise ConfigError(f"{parallel_source} with clip_model_path and {which}: parallel slots do not draft for "
                              "prompts with images or audio (a draft would be handed their positions as tokens); "
                              "serve the projector without a draft, or with parallel 1")


SettingSource = Callable[[int, str], str]
"""``source(index, field)``: where model ``index``'s setting ``field`` was given (a flag, variable or config key)."""

MULTIMODAL_CHAT_FORMATS = SERVER_CHAT_FORMATS - {"hf-autotokenizer", "hf-tokenizer-config"}
"""The chat formats whose handler llama_cpp.server builds with the ``clip_model_path`` projector: the only ones that
read images (any other format drops them, a projector file or not)."""

FORMAT_NEEDS: dict[str, tuple[str, str]] = {
    **{name: ("clip_model_path", "the multimodal projector file") for name in MULTIMODAL_CHAT_FORMATS},
    "hf-autotokenizer": ("hf_pretrained_model_name_or_path", "the Hugging Face tokenizer"),
    "hf-tokenizer-config": ("hf_tokenizer_config_path", "a tokenizer_config.json file"),
}
"""The chat formats llama_cpp.server builds by name, and the setting each needs (it asserts it as the model loads)."""

GGUF_FILE_SETTINGS = ("lora_base", "lora_path", "clip_model_path")
"""Model settings that name a local GGUF file (a ``clip_model_path`` is a file of the repository instead when
``hf_model_repo_id`` is set)."""



def _kv_bool(text: str) -> bool:
    # llama_cpp.server reads any word but true and 1 as false: a typo would turn a setting off unsaid.
    if text.lower() not in ("true", "false", "1", "0"):
        raise ValueError(text)
    return text.lower() in ("true", "1")


KV_OVERRIDE_TYPES: dict[str, Callable[[str], object]] = {"int": int, "float": float, "bool": _kv_bool, "str": str}


def check_model_settings(models: list[ModelSettings], source: SettingSource) -> None:
    """Refuse, before a model loads, the model settings llama_cpp.server reads only as it loads one.

    :raises ConfigError: Naming the setting, where it was given and what it needs.
    """
    for index, model in enumerate(models):
        needed = FORMAT_NEEDS.get(model.chat_format or "")
        if needed is not None and getattr(model, needed[0]) is None:
            raise ConfigError(f"{source(index, 'chat_format')}: chat format {model.chat_format!r} needs "
                              f"{needed[0]} ({needed[1]}), which is not set")
        for field in GGUF_FILE_SETTINGS:
            path = getattr(model, field)
            if path is not None and not (field == "clip_model_path" and model.hf_model_repo_id is not None):
                check_model_file(path, source(index, field))
        if model.hf_tokenizer_config_path is not None:
            _check_json_file(model.hf_tokenizer_config_path, source(index, "hf_tokenizer_config_path"))
        if model.hf_pretrained_model_name_or_path is not None and importlib.util.find_spec("transformers") is None:
            raise ConfigError(f"{source(index, 'hf_pretrained_model_name_or_path')}: a Hugging Face tokenizer needs "
                              "the transformers package: pip install transformers")
        for override in model.kv_overrides or []:
            _check_kv_override(override, source(index, "kv_overrides"))
        for field in ("type_k", "type_v"):
            _check_ggml_type(getattr(model, field), source(index, field))


def _check_json_file(path: str, source: str) -> None:
    try:
        with open(path, "rb") as handle:
            json.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such file: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: {path} is a directory, not a JSON file") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ConfigError(f"{source}: {path} is not valid JSON: {exc}") from None


def _check_kv_override(override: str, source: str) -> None:
    """llama_cpp.server's reading of one ``KEY=TYPE:VALUE`` override: it unpacks ``split("=")`` and ``split(":")``
    (a traceback on any other count) and ignores an override without a type."""
    form = "KEY=TYPE:VALUE, TYPE one of int, float, bool, str"
    parts = override.split("=")
    typed = parts[1].split(":") if len(parts) == 2 else []
    if len(typed) != 2 or typed[0] not in KV_OVERRIDE_TYPES:
        raise ConfigError(f"{source}: {override!r} is not {form} (one '=' and one ':')")
    try:
        KV_OVERRIDE_TYPES[typed[0]](typed[1])
    except ValueError:
        raise ConfigError(f"{source}: {override!r}: {typed[1]!r} is not of type {typed[0]}") from None


def _check_ggml_type(value: int | None, source: str) -> None:
    """A KV cache type must be one of ggml's (llama.cpp refuses the context otherwise, after loading the model)."""
    if value is None:
        return
    from llama_cpp import llama_cpp as lib

    names = {getattr(lib, name): name[len("GGML_TYPE_"):].lower() for name in dir(lib)
             if name.startswith("GGML_TYPE_") and name != "GGML_TYPE_COUNT"}
    if value not in names:
        raise ConfigError(f"{source}: {value} is not a ggml type (e.g. {lib.GGML_TYPE_F16} for f16, "
                          f"{lib.GGML_TYPE_Q8_0} for q8_0)")


def check_directory(path: str, source: str) -> None:
    """Make sure ``path`` is a directory this process can write, creating it (as the disk tier and slot saves
    would on first use) where it is missing.

    :raises ConfigError: ``path`` is a file, or cannot be created or written.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{source}: {path} is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{source}: cannot create the directory {path}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{source}: no permission to write to {path}")
