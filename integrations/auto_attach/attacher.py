"""Attach every ``llama_cpp.Llama`` a program creates, as it is created.

``Llama.__init__`` is wrapped once per process (:mod:`.startup`); the wrapper calls :func:`construct`, which runs
the original constructor (with the configured overrides of its arguments), then :func:`ckpt_plugin.attach` with the
configured settings, through the installed :class:`AutoAttacher`: the one :func:`install` made, or, under
``ckpt-run`` / ``CKPT_AUTO_ATTACH=1``, one made from the environment when the first ``Llama`` is created.

Embedding and vocab-only models cannot be attached (``attach`` raises :class:`~ckpt_plugin.UnsupportedHostError`):
they are left as they are, with a debug log.
Llamas of the same model file share one prompt cache, so a program that creates a new ``Llama`` per job (or a
library that does) finds the entries of the previous ones; entries of other context settings stay apart by their
fingerprint. Closing an attached ``Llama`` first puts its live conversation into that cache (a multi-model
``llama_cpp.server`` closes one model to load another).
"""

from __future__ import annotations

import atexit
import inspect
import logging
import os
import sys
import threading
import weakref
from typing import Any, Callable

import llama_cpp
from llama_cpp import Llama

from ckpt_plugin import (
    CheckpointManager,
    CheckpointSettings,
    PromptCache,
    UnsupportedHostError,
    attach,
    manager_of,
)
from ckpt_plugin.hosts.llama_cpp.seam import compat as host_compat
from ckpt_plugin.tiers.registry import TIERS

from ckpt_plugin_integrations.auto_attach.llama_hook import enabled, wrap_llama_init
from ckpt_plugin_integrations.auto_attach.logs import show_logs
from ckpt_plugin_integrations.auto_attach.metrics_server import MetricsServer
from ckpt_plugin_integrations.auto_attach.settings import check_llama_overrides, load_checkpoint_settings, load_run_settings

log = logging.getLogger("ckpt_plugin.auto_attach")


def model_label(llama: Llama) -> str:
    """The name an attached ``Llama`` is reported under: its model file's name."""
    return os.path.basename(str(llama.model_path)) or "model"


class AutoAttacher:
    """What the wrapped ``Llama.__init__`` does with the settings it was given, and the Llamas it attached.

    :param settings: Checkpoint settings of every manager.
    :param llama_overrides: Constructor arguments that replace what the program passes.
    :param metrics: Started on the first attach, if given.
    """

    def __init__(
        self,
        settings: CheckpointSettings,
        llama_overrides: dict[str, Any] | None = None,
        metrics: MetricsServer | None = None,
    ) -> None:
        self.settings = settings
        self.llama_overrides = dict(llama_overrides or {})
        check_llama_overrides(self.llama_overrides, Llama.__init__)
        self.metrics = metrics
        self._lock = threading.Lock()
        self._llamas: dict[str, weakref.ref[Llama]] = {}
        self._caches: dict[str, PromptCache] = {}
        self._disk = TIERS.disk(settings.disk_dir, settings.disk_max_bytes) if settings.disk_dir else None
        if self._disk is not None:
            # The live conversations go to the disk tier too, so that the next run starts warm.
            atexit.register(self.flush)

    # -- what it does ------------------------------------------------------------------------------------------------

    def flush(self) -> None:
        """Put every attached Llama's live conversation into its cache (and disk tier)."""
        for manager in self.managers().values():
            manager.flush()

    def construct(self, wrapped: Callable[..., None], instance: Llama, args: tuple, kwargs: dict) -> None:
        """Run ``Llama.__init__`` (``wrapped``) with the overrides applied, then attach ``instance``."""
        if self.llama_overrides:
            args, kwargs = self._override(wrapped, args, kwargs)
        wrapped(*args, **kwargs)
        self.attach(instance)

    def _override(self, init: Callable[..., None], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        try:
            bound = inspect.signature(init).bind(*args, **kwargs)
        except TypeError:
            return args, kwargs  # let the constructor report the bad call in its own words
        bound.arguments.update(self.llama_overrides)
        return bound.args, bound.kwargs

    def attach(self, llama: Llama) -> CheckpointManager | None:
        """Attach ``llama`` (what the wrapper does after the constructor); ``None`` if it cannot be attached."""
        label = model_label(llama)
        try:
            manager = attach(llama, self.settings, cache=self._cache_for(llama), disk=self._disk)
        except UnsupportedHostError as exc:
            # Embedding and vocab-only models have no generation state: expected, so only a debug line.
            expected = llama.context_params.embeddings or llama.model_params.vocab_only
            log.log(logging.DEBUG if expected else logging.WARNING, "not attaching %s: %s", label, exc)
            return None
        except Exception:  # noqa: BLE001 - the program asked for a Llama, not for checkpoints: it gets its Llama
            log.exception("not attaching %s: attach failed", label)
            return None
        label = self._register(label, llama)
        park_before_close(llama, manager)
        log.debug("attached %s (model %s)", label, llama.model_path)
        if self.metrics is not None:
            self.metrics.watch(label, manager)
        return manager

    def _cache_for(self, llama: Llama) -> PromptCache:
        key = os.path.realpath(str(llama.model_path))
        with self._lock:
            cache = self._caches.get(key)
            if cache is None:
                cache = self._caches[key] = TIERS.ram(("ckpt-run", key), self.settings.cache_max_bytes,
                                                      self.settings.cache_max_tokens)
            return cache

    def _register(self, label: str, llama: Llama) -> str:
        with self._lock:
            unique, n = label, 1
            while self._taken(unique):
                n += 1
                unique = f"{label}#{n}"
            self._llamas[unique] = weakref.ref(llama)
            return unique

    def _taken(self, label: str) -> bool:
        # A label comes free when its Llama is gone or detached.
        ref = self._llamas.get(label)
        holder = ref() if ref is not None else None
        return holder is not None and manager_of(holder) is not None

    # -- what it attached --------------------------------------------------------------------------------------------

    def managers(self) -> dict[str, CheckpointManager]:
        """The managers of the Llamas it attached that are alive and still attached, by model label."""
        with self._lock:
            llamas = {label: ref() for label, ref in self._llamas.items()}
        found = {label: manager_of(llama) for label, llama in llamas.items() if llama is not None}
        return {label: manager for label, manager in found.items() if manager is not None}


def park_before_close(llama: Llama, manager: CheckpointManager) -> None:
    """Put ``llama``'s live conversation into its cache when the program closes it (this instance's ``close``).

    A host that switches models closes one ``Llama`` and creates another (``llama_cpp.server`` with several models
    in its ``--config_file``); Llamas of one model file share a prompt cache, so the conversation parked here is
    found again when that model is loaded back, as under ckpt-serve.
    """
    close = llama.close

    def close_after_parking() -> None:
        # Still attached (not detached meanwhile), its context not freed yet (Llama.__del__ calls close again, also
        # after an explicit close, and garbage collection may free the context first), the interpreter not exiting.
        if manager_of(llama) is manager and host_compat.context_alive(llama) and not sys.is_finalizing():
            try:
                manager.flush()
            except Exception:  # noqa: BLE001 - closing must not fail for a cache that could not be filled
                log.exception("could not put the live conversation of %s into its cache", model_label(llama))
        close()

    llama.close = close_after_parking  # type: ignore[method-assign]


_current: AutoAttacher | None = None
_from_environment = enabled()  # made on the first Llama, unless install() or uninstall() came first
_current_lock = threading.Lock()


def construct(wrapped: Callable[..., None], instance: Llama, args: tuple, kwargs: dict) -> None:
    """What the wrapped ``Llama.__init__`` does: construct, then attach through the installed attacher, if any."""
    attacher = _installed()
    if attacher is None:
        wrapped(*args, **kwargs)
    else:
        attacher.construct(wrapped, instance, args, kwargs)


def _installed() -> AutoAttacher | None:
    global _current, _from_environment
    if not _from_environment:
        return _current
    with _current_lock:
        if _from_environment:
            _from_environment = False
            try:
                _current = _attacher_from_environment()
            except Exception as exc:  # noqa: BLE001 - the program must run on, only without checkpoints
                log.error("auto-attach is off: %s", exc)
        return _current


def _attacher_from_environment() -> AutoAttacher:
    run = load_run_settings()
    show_logs(run.log_level)
    attacher = AutoAttacher(load_checkpoint_settings(run.config_file), run.llama_overrides)
    if run.metrics_port is not None:
        attacher.metrics = MetricsServer(run.metrics_port, run.metrics_host, attacher.managers)
    if run.stats_at_exit:
        atexit.register(print_summary, attacher)
    return attacher


def summary(label: str, stats: dict[str, Any]) -> str:
    """One line of what the plugin did for one ``Llama``: prompts, tokens reused (not evaluated) and evaluated, hits."""
    reused, evaluated = int(stats["tokens_reused"]), int(stats["tokens_evaluated"])
    total = reused + evaluated
    share = f" ({100 * reused / total:.0f}% reused)" if total else ""
    return (f"ckpt_plugin: {label}: {stats['prompts']} prompts, {reused:,} tokens reused and {evaluated:,} evaluated"
            f"{share}, {stats['cache_hits']} cache hits, {stats['checkpoints_created']} checkpoints taken, "
            f"{stats['checkpoints_restored']} restored")


def print_summary(attacher: AutoAttacher) -> None:
    """Print :func:`summary` of every attached ``Llama`` to stderr (``--stats-at-exit``, at interpreter exit)."""
    for label, manager in attacher.managers().items():
        print(summary(label, manager.stats()), file=sys.stderr)


def install(
    settings: CheckpointSettings | None = None,
    *,
    llama_overrides: dict[str, Any] | None = None,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
    **overrides: Any,
) -> AutoAttacher:
    """Attach every ``llama_cpp.Llama`` created from now on (replacing an earlier :func:`install`).

    :param settings: Checkpoint settings; keyword arguments override fields (``install(cache_max_bytes="1GiB")``).
    :param llama_overrides: ``Llama`` constructor arguments that replace what the program passes.
    :param metrics_port: Serve Prometheus metrics of the attached Llamas on this port (from the first attach on).
    :param metrics_host: The address that endpoint listens on.
    :raises ConfigError: An override names no ``Llama`` parameter.
    :raises pydantic.ValidationError: A setting is invalid.
    """
    global _current, _from_environment
    base = settings.model_dump() if settings is not None else {}
    attacher = AutoAttacher(CheckpointSettings(**{**base, **overrides}), llama_overrides)
    if metrics_port is not None:
        attacher.metrics = MetricsServer(metrics_port, metrics_host, attacher.managers)
    wrap_llama_init(llama_cpp, construct)
    with _current_lock:
        _current, _from_environment = attacher, False
    return attacher


def uninstall() -> None:
    """Stop attaching new Llamas (those attached stay attached; ``ckpt_plugin.detach`` them)."""
    global _current, _from_environment
    with _current_lock:
        _current, _from_environment = None, False


def current() -> AutoAttacher | None:
    """The installed :class:`AutoAttacher`, if any."""
    return _installed()


def managers() -> dict[str, CheckpointManager]:
    """The managers of the Llamas attached automatically, by model label (empty when not installed)."""
    attacher = _installed()
    return attacher.managers() if attacher is not None else {}
