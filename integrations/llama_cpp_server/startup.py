"""What ckpt-serve says once its models are loaded: one start-up line, and the refusal of a budget too small to hold
one cache entry (docs/server.md, "The start-up line"); or, where they failed to load for a reason the user can fix,
that reason in one line."""

from __future__ import annotations

from typing import Any

from llama_cpp.server.settings import ModelSettings

from ckpt_plugin.core.config import ServeSettings
from ckpt_plugin.core.errors import ConfigError
from ckpt_plugin.plugins.default import DEFAULT_PLUGIN_NAME
from ckpt_plugin.hosts.llama_cpp.serving.default_model import is_default_model
from ckpt_plugin.services.stats import plugin_names

from ckpt_plugin_integrations.llama_cpp_server.kv_events import kv_events_text
from ckpt_plugin_integrations.llama_cpp_server.model_checks import gguf_strings
from ckpt_plugin_integrations.llama_cpp_server.settings import LoadedSettings
from ckpt_plugin_integrations.settings_flags import format_size

INTERNAL_PLUGINS = frozenset({DEFAULT_PLUGIN_NAME, "ckpt_plugin.http.metrics"})
"""Plugins every manager of ckpt-serve has: the start-up line names only the others (entry points, your own)."""


def chat_format_text(model: ModelSettings) -> str:
    """How chat requests to ``model`` are formatted: its chat format, its GGUF's template, or llama-2 as fallback."""
    if model.chat_format is not None:
        return model.chat_format
    if model.hf_model_repo_id is not None:
        return "the GGUF's chat template"
    metadata = gguf_strings(model.model, {"tokenizer.chat_template"})
    if metadata and "tokenizer.chat_template" in metadata:
        return "the GGUF's chat template"
    return "llama-2 (the GGUF has no chat template)"


def base_url(host: str, port: int, tls: bool) -> str:
    """The URL clients use, with the OpenAI API's ``/v1``."""
    shown = f"[{host}]" if ":" in host else host
    return f"{'https' if tls else 'http'}://{shown}:{port}/v1"


def _model_text(model: ModelSettings, loaded: bool, several: bool) -> str:
    alias = model.model_alias or model.model
    text = alias if alias == model.model else f"{alias} ({model.model})"
    if is_default_model(model.model):
        text += " (the built-in Gemma-3-270M)"
    return f"{text}{' (loaded)' if loaded and several else ''}"


def startup_line(url: str, models: list[ModelSettings], managers: dict[str, Any], settings: ServeSettings,
                 kv_events: Any | None = None) -> str:
    """The start-up line: the models (the loaded one first), address, chat format, slots, state budget, tiers,
    admin, metrics and slot routes, the plugins loaded besides ckpt_plugin's own, and where the KV events
    (``kv_events``, their publisher) go."""
    current = next(iter(managers), None)
    loaded = next((m for m in models if (m.model_alias or m.model) == current), models[0])
    others = [m for m in models if m is not loaded]
    manager = managers.get(current) if current is not None else None
    parts = [
        "serving " + ", ".join(_model_text(m, m is loaded, bool(others)) for m in [loaded, *others]) + f" at {url}",
        f"chat format {chat_format_text(loaded)}",
        f"{settings.parallel} slot{'s' if settings.parallel > 1 else ''} of n_ctx {loaded.n_ctx}"
        + (" in one pool of cells" if settings.parallel > 1 and settings.kv_unified else ""),
    ]
    if manager is not None:
        budget = manager.cache.max_bytes
        parts.append(f"state budget {format_size(budget)}" if budget else "state budget 0 (reuse off)")
        tiers = ["ram"]
        if manager.disk is not None:
            tiers.append(f"disk {settings.disk_dir} ({format_size(settings.disk_max_bytes)})")
        if manager.store.shared is not None:
            tiers.append(f"shared {manager.store.shared.stats()['url']}")
        parts.append("tiers " + " + ".join(tiers))
        extra = [name for name in plugin_names(manager.plugins) if name not in INTERNAL_PLUGINS]
        parts.append("plugins " + (", ".join(extra) if extra else "none besides ckpt_plugin's own"))
    parts.append("admin routes on (/checkpoints, /checkpoints/stats)" if settings.admin
                 else "admin routes off (--admin true)")
    parts.append("metrics /metrics" if settings.metrics else "metrics off")
    parts.append(f"slot files in {settings.slot_save_path}" if settings.slot_save_path
                 else "slot files off (--slot-save-path)")
    events = kv_events_text(kv_events)
    if events is not None:
        parts.append(events)
    return "ckpt-serve: " + "; ".join(parts)


def check_budgets(managers: dict[str, Any], floors: dict[str, int], source: str) -> None:
    """Refuse a state budget that cannot hold one prompt-cache entry of a loaded model: every entry would be refused
    and nothing reused. A budget of 0 is taken as reuse turned off on purpose.

    :param floors: The least bytes of one entry by model
        (:func:`~ckpt_plugin.hosts.llama_cpp.serving.model_sizes.entry_floor_bytes`).
    :param source: The flag, variable or config key that set the budget.
    :raises ConfigError: Naming ``source``, the budget and what one entry needs.
    """
    for alias, manager in managers.items():
        budget, floor = manager.cache.max_bytes, floors.get(alias, 0)
        if 0 < budget < floor:
            raise ConfigError(
                f"{source}: a state budget of {budget:,} bytes cannot hold one prompt-cache entry of {alias} (at "
                f"least {floor:,} bytes: {manager.settings.cache_min_tokens} tokens of its KV cache), so nothing "
                f"would be reused; give at least {format_size(-(-floor // 1024) * 1024)}, e.g. 1GiB, or 0 to turn "
                "reuse off"
            )


def budget_source(loaded: LoadedSettings) -> str:
    """What set the state budget: the checkpoint setting where it was given, else the host's ``cache_size`` where
    ``--cache true`` applies it, else the default of ``--cache-max-bytes``."""
    source = loaded.checkpoint_sources.get("cache_max_bytes")
    if source is not None:
        return source
    if loaded.models[0].cache:
        return loaded.model_source(0, "cache_size")
    return "--cache-max-bytes (default)"


DOWNLOAD_ERROR_MODULES = frozenset({"huggingface_hub", "httpx", "httpx2", "requests", "urllib3"})
"""Packages whose exceptions, while a model named by ``hf_model_repo_id`` loads, mean its download failed."""


def load_failure(models: list[ModelSettings], exc: Exception) -> str | None:
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
