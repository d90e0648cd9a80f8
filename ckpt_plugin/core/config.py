"""Settings of a checkpoint manager, from keyword arguments or ``CKPT_*`` environment variables."""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Iterable, Mapping
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict

from ckpt_plugin.core.entry import DEFAULT_MAX_BYTES
from ckpt_plugin.core.pages import DEFAULT_PAGE_POSITIONS
from ckpt_plugin.core.kv_events_config import KvEventsConfig, parse_kv_events_config

__all__ = [
    "CheckpointSettings",
    "ServeSettings",
    "check_redis_url",
    "combination_error",
    "parse_size",
    "physical_memory_bytes",
    "setting_variables",
    "unknown_variables",
]


def physical_memory_bytes() -> int:
    """Total physical memory of this machine in bytes (0 if the platform does not say)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as ``"2GiB"``, ``"512 MB"`` or ``"1048576"``."""
    if isinstance(value, int):
        return value
    text = str(value).strip().lower().replace("_", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = text[len(number):].strip()
    try:
        amount = float(number) if unit in _UNITS else math.nan
    except ValueError:
        amount = math.nan
    if not math.isfinite(amount) or amount < 0:
        raise ValueError(f"not a byte size: {value!r} (use e.g. 2GiB, 512MB or a number of bytes)")
    return int(amount * _UNITS[unit])


# CKPT_* variables that are no settings: the test suite's and tools' own.
_NON_SETTING_PREFIXES = ("CKPT_TEST_", "CKPT_FUZZ_", "CKPT_UPSTREAM_")


def setting_variables(*settings: type[BaseSettings]) -> set[str]:
    """The ``CKPT_*`` environment variables the given settings classes read."""
    return {f"CKPT_{name.upper()}" for cls in settings for name in cls.model_fields}


def unknown_variables(environ: Mapping[str, str], known: Iterable[str]) -> list[str]:
    """One warning per ``CKPT_*`` variable of ``environ`` that is not in ``known`` (they are ignored), naming the
    closest known name; variables are matched without regard to case, as the settings read them."""
    names = sorted({name.upper() for name in known})
    warnings = []
    for variable in sorted(environ):
        upper = variable.upper()
        if not upper.startswith("CKPT_") or upper in names or upper.startswith(_NON_SETTING_PREFIXES):
            continue
        close = difflib.get_close_matches(upper, names, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else " (docs/configuration.md lists the CKPT_* settings)"
        warnings.append(f"{variable} is not a ckpt_plugin setting and is ignored{hint}")
    return warnings


def check_redis_url(url: str) -> None:
    """Refuse a shared-tier URL redis-py would not take (the message never repeats the URL: it may hold a password).

    :raises ValueError: Saying what is wrong.
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError("redis_url is not a URL (bad port or brackets)") from None
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"redis_url must start with redis://, rediss:// or unix://, not {parts.scheme or 'nothing'}")
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError("redis_url unix:// needs the socket's path")
    else:
        if not parts.hostname:
            raise ValueError("redis_url needs a host (redis://host:port/db)")
        if port == 0:
            raise ValueError("redis_url has port 0")
        if parts.path not in ("", "/") and not re.fullmatch(r"/\d+", parts.path):
            raise ValueError("redis_url's path must be a database number (redis://host:port/0)")
    try:
        import xxhash  # noqa: F401
        from redis.connection import parse_url
    except ImportError:
        raise ValueError("redis_url needs redis-py and xxhash: pip install 'ckpt_plugin[redis]'") from None
    try:
        parse_url(url)
    except ValueError as exc:
        problem = str(exc) if url not in str(exc) else "malformed"
        raise ValueError(f"redis_url is refused by redis-py: {problem}") from None


class CheckpointSettings(BaseSettings):
    """What a :class:`~ckpt_plugin.engine.manager.CheckpointManager` does and how much memory it may use.

    Unknown keys are refused with an error naming them. See ``docs/configuration.md`` for the reasoning behind each
    default.
    """

    # Inputs stay out of error messages: redis_url and admin_key are secrets.
    model_config = SettingsConfigDict(env_prefix="CKPT_", extra="forbid", validate_assignment=True,
                                      hide_input_in_errors=True)

    max_checkpoints: int = Field(32, ge=0, description="Checkpoints kept per slot (llama.cpp: n_ctx_checkpoints).")
    checkpoint_min_step: int | None = Field(
        None,
        ge=1,
        description="Minimum spacing in tokens of checkpoints inside a prompt; None picks it by memory kind: 256 for "
        "sliding-window models (a checkpoint holds the window, 7.9 MB on Gemma-3-270M), 64 for recurrent and "
        "hybrid models (a checkpoint holds only the recurrent state). llama.cpp uses 8192, sized for long contexts.",
    )
    cache_max_bytes: int = Field(DEFAULT_MAX_BYTES, ge=0, description="Prompt-cache byte budget (unique bytes).")
    page_positions: int = Field(
        DEFAULT_PAGE_POSITIONS, ge=0, le=4096,
        description="Positions a page of a stored state covers: states are kept as pages identified by their "
        "content, each stored once however many checkpoints, entries and tiers hold it; 0 keeps every state whole.",
    )
    cache_max_tokens: int | None = Field(None, ge=0, description="Prompt-cache token budget; None for none.")
    cache_min_tokens: int = Field(
        32, ge=1, description="A slot state shorter than this is not worth a cache entry when the slot switches."
    )
    cache_min_discard: int = Field(
        16,
        ge=1,
        description="The live state goes into the cache before a new prompt discards at least this many of its "
        "tokens, so that coming back to it is a hit.",
    )
    namespace: str = Field("default", min_length=1, description="Cache partition of this manager's requests.")
    disk_dir: str | None = Field(
        None, description="Directory of the prompt cache's disk tier (entries survive restarts); None for RAM only."
    )
    disk_max_bytes: int = Field(10 << 30, ge=0, description="Byte budget of the disk tier.")
    redis_url: SecretStr | None = Field(
        None,
        description="Redis or Valkey server of the shared tier (redis://[:password@]host:port/db, rediss:// for "
        "TLS, unix://path): replicas pointing at one server resume each other's conversations; None for none.",
    )
    redis_prefix: str = Field("ckpt", pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                              description="First part of the shared tier's keys (deployments sharing a server).")
    redis_ttl: int | None = Field(
        None, ge=1, description="Seconds the shared tier's keys live after their last write; None leaves eviction "
        "to the server's maxmemory policy (allkeys-lru).",
    )
    redis_timeout: float = Field(0.5, gt=0, le=60, description="Seconds a shared-tier read or connection may take.")
    redis_queue: int = Field(8, ge=0, description="Entries waiting to be written to the shared tier at most; more "
                             "are dropped (counted).")
    redis_retry: float = Field(2.0, gt=0, le=3600,
                               description="Seconds between probes of an unreachable shared-tier server.")
    load_entrypoints: bool = Field(True, description="Load plugins from the 'ckpt_plugin' entry-point group.")
    plan_by_cost: bool = Field(
        True, description="Choose the plan with the least expected time (restore plus evaluation, from rates "
        "measured on this machine) rather than the one keeping the most tokens, and skip checkpoints that cost more "
        "to copy than they save; false: keep the most tokens, take every checkpoint (rates are still measured).",
    )

    @field_validator("cache_max_bytes", "disk_max_bytes", mode="before")
    @classmethod
    def _size(cls, value: int | str) -> int:
        return parse_size(value)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            check_redis_url(value.get_secret_value())
        return value

    @field_validator("cache_max_bytes")
    @classmethod
    def _fits_in_memory(cls, value: int) -> int:
        total = physical_memory_bytes()
        if total and value > total:
            raise ValueError(
                f"cache_max_bytes={value} is larger than this machine's physical memory ({total} bytes)"
            )
        return value


def combination_error(message: str, *fields: str) -> PydanticCustomError:
    """A validation error about settings that do not go together, naming them in its context (``ctx["fields"]``),
    so that a command line can say which flags, variables or config keys gave them."""
    return PydanticCustomError("settings_combination", message, {"fields": fields})


class ServeSettings(CheckpointSettings):
    """Checkpoint settings of a server: the manager's, plus what the middleware exposes and how tenants are told
    apart (``checkpoints`` section of ``ckpt-serve``'s config file, ``--checkpoint-*`` flags, ``CKPT_*``)."""

    admin: bool = Field(False, description="Serve GET/DELETE /checkpoints (protected by the host's API key).")
    metrics: bool = Field(True, description="Serve GET /metrics (protected by the host's API key).")
    namespaces: Literal["off", "api_key", "header"] = Field(
        "off",
        description="Cache partition of a request: 'off' (one shared namespace), 'api_key' (a hash of the bearer "
        "key), 'header' (a hash of the header named by namespace_header, set by the operator's gateway).",
    )
    namespace_header: str | None = Field(None, description="Header carrying the tenant id when namespaces='header'.")
    draft_model: str | None = Field(
        None, description="GGUF of a draft model for speculative decoding (same vocabulary as the served model)."
    )
    draft_n: int = Field(4, ge=1, le=64, description="Tokens drafted per step by the draft model.")
    slot_save_path: str | None = Field(
        None,
        description="Directory of slot files for POST /slots/{id}?action=save|restore|erase; off when unset. With "
        "namespaces on, each tenant's files live in a subdirectory of their own.",
    )
    admin_key: SecretStr | None = Field(
        None,
        description="Operator key: a bearer token that passes the host's API key check on admin, metrics and slot "
        "routes, sees every namespace in GET /checkpoints, and may read /checkpoints/stats when namespaces are on.",
    )
    max_body_bytes: int = Field(
        32 << 20, ge=1024, description="Largest request body accepted on any route (413 above it)."
    )
    swa_full: bool | None = Field(
        False,
        description="Sliding-window models: a window cache of the window's size (false, llama-server's default: far "
        "less memory, and checkpoints keep prefix reuse exact) or a full-size one (true, llama_cpp.Llama's default).",
    )
    shutdown_timeout: float = Field(
        5.0, ge=0, description="Seconds ckpt-serve waits for requests in flight on SIGTERM before closing them."
    )
    request_timeout: float | None = Field(
        600.0, gt=0, description="Seconds a completion may run, its prompt's evaluation included, before it is "
        "stopped (finish_reason 'length'); None for no limit.",
    )
    grammar_max_step_seconds: float | None = Field(
        1.0, gt=0, description="Grammars and JSON schemas whose one sampling step over the model's vocabulary takes "
        "longer (timed in the grammar check's child process) are refused (422): the host pays that step for every "
        "token it generates. None for no limit.",
    )
    grammar_check_seconds: float = Field(
        1.0, gt=0, description="Seconds compiling a request's grammar or JSON schema may take (in the grammar check's "
        "child process, before the request waits for a slot) before it is refused (422).",
    )
    request_max_tokens: int | None = Field(
        None, ge=1, description="Tokens a completion may generate at most, whatever its max_tokens asks "
        "(finish_reason 'length'); None for no limit beyond the context.",
    )
    parallel: int = Field(
        1, ge=1, le=256, description="Slots: conversations served at once over one model context, their tokens "
        "decoded in shared batches, each slot holding a whole n_ctx (with kv_unified, one pool of n_ctx cells). 1: one "
        "request at a time, as the host serves.",
    )
    max_queued: int = Field(
        64, ge=0, description="With parallel > 1: requests that may wait for a free slot (first come, first served); "
        "a request past them gets 503.",
    )
    kv_unified: bool = Field(
        False, description="With parallel > 1: one pool of n_ctx KV cells for all the slots, each able to grow to the "
        "whole context (llama-server's --kv-unified; -c is then the pool), instead of n_ctx cells per slot. With "
        "plain attention, a prompt sharing a prefix with another slot's live memory shares its cells, and requests "
        "arriving together with one new prefix evaluate it once. Ignored with parallel 1.",
    )

    kv_events_config: KvEventsConfig | None = Field(
        None, description="vLLM's --kv-events-config, the same JSON object (e.g. '{\"enable_kv_cache_events\": "
        "true, \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}'): publish BlockStored, "
        "BlockRemoved and AllBlocksCleared for the pages of the states this server holds, as vLLM publishes its "
        "blocks (ZeroMQ, msgpack), for KV-aware routers. Needs pip install 'ckpt_plugin[kv-events]'. None: off.",
    )

    @field_validator("max_body_bytes", mode="before")
    @classmethod
    def _body_size(cls, value: int | str) -> int:
        return parse_size(value)

    @field_validator("kv_events_config", mode="before")
    @classmethod
    def _kv_events_config(cls, value: object) -> object:
        return parse_kv_events_config(value)

    @model_validator(mode="after")
    def _header_named(self) -> "ServeSettings":
        if self.namespaces == "header" and not self.namespace_header:
            raise combination_error("namespaces='header' needs namespace_header (the header your gateway sets)",
                                    "namespaces")
        return self
