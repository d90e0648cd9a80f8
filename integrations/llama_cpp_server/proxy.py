"""A ``LlamaProxy`` that attaches a checkpoint manager to every model the server loads."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import llama_cpp
from llama_cpp.server.model import LlamaProxy
from llama_cpp.server.settings import ModelSettings

from ckpt_plugin.hosts.llama_cpp.seam import compat as host_compat
from ckpt_plugin import CheckpointManager, CheckpointSettings, PromptCache, attach
from ckpt_plugin.hosts.llama_cpp.serving.plain_llama import open_llama
from ckpt_plugin.hosts.llama_cpp.serving.model_sizes import entry_floor_bytes
from ckpt_plugin.hosts.llama_cpp.parallel.parallel_llama import ParallelLlama
from ckpt_plugin.hosts.llama_cpp.speculative.drafts import enable_speculative
from ckpt_plugin.core.config import ServeSettings
from ckpt_plugin.tiers.disk import DiskTier
from ckpt_plugin.tiers.registry import TIERS


_CREATE_LOCK = threading.Lock()


@contextlib.contextmanager
def window_cache(swa_full: bool | None) -> Iterator[None]:
    """Models created meanwhile get ``swa_full`` (``llama_cpp.server``'s model settings have no such field, and its
    loader creates the ``Llama`` through ``llama_cpp.Llama``)."""
    if swa_full is None:
        yield
        return

    class WindowLlama(llama_cpp.Llama):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("swa_full", swa_full)
            super().__init__(*args, **kwargs)

    with _CREATE_LOCK:
        original, llama_cpp.Llama = llama_cpp.Llama, WindowLlama
        try:
            yield
        finally:
            llama_cpp.Llama = original


class CheckpointLlamaProxy(LlamaProxy):
    """``llama_cpp.server``'s model proxy, with checkpoints.

    Each model alias keeps its own prompt cache across model switches: the live conversation is parked in the cache
    before the server closes a model, and the entries stay valid for the reloaded model (same fingerprint), so
    switching back is warm.

    With ``settings.parallel`` > 1 the model is served by
    :class:`~ckpt_plugin.hosts.llama_cpp.parallel.parallel_llama.ParallelLlama` (N slots, batched): each call returns a
    per-request view of the model, bound to a slot when its generation starts.

    :param models: The server's model settings.
    :param settings: Checkpoint settings applied to every model.
    :ivar parallel: The parallel slots of the loaded model, if ``settings.parallel`` > 1.
    """

    def __init__(self, models: list[ModelSettings], settings: ServeSettings) -> None:
        self.draft_model = settings.draft_model
        self.draft_n = settings.draft_n
        self.swa_full = settings.swa_full
        self.checkpoint_settings = CheckpointSettings(
            **settings.model_dump(include=set(CheckpointSettings.model_fields))
        )
        self.n_parallel = settings.parallel
        self.kv_unified = settings.kv_unified
        self.parallel: ParallelLlama | None = None
        self.managers: dict[str, CheckpointManager] = {}
        self._caches: dict[str, PromptCache] = {}
        # Of each model unloaded by a switch: its counters (the next manager of that alias starts from them) and its
        # last stats (what /checkpoints/stats and /metrics show of it meanwhile).
        self._counts: dict[str, dict[str, Any]] = {}
        # The least bytes one prompt-cache entry of each model loaded so far takes (ckpt-serve checks its budget).
        self.entry_floors: dict[str, int] = {}
        self._unloaded: dict[str, dict[str, Any]] = {}
        self._disk: DiskTier | None = None
        if settings.disk_dir is not None:
            self._disk = TIERS.disk(settings.disk_dir, settings.disk_max_bytes)
        super().__init__(models)

    def __call__(self, model: str | None = None) -> Any:
        alias = host_compat.proxy_model_alias(self, model)
        if alias != host_compat.proxy_current_alias(self):
            for name, manager in self.managers.items():
                manager.flush()
                self._counts[name] = manager.counters.snapshot()
                self._unloaded[name] = {**manager.stats(), "loaded": False}
            self.managers = {}
        llama = super().__call__(model)
        parallel = self.parallel
        return parallel.view() if parallel is not None else llama

    def load_llama_from_model_settings(self, settings: ModelSettings) -> Any:  # type: ignore[override]
        if self.draft_model is not None and self.n_parallel <= 1:
            # llama-cpp-python samples every drafted position: the target needs logits for the whole batch (parallel
            # slots compute the rows a verification samples by themselves).
            settings = settings.model_copy(update={"logits_all": True})
        with window_cache(self.swa_full):
            llama = LlamaProxy.load_llama_from_model_settings(settings)
        alias = settings.model_alias or settings.model
        cache = self._caches.get(alias)
        if cache is None:
            # Held here: the alias keeps its cache across model switches.
            cache = self._caches[alias] = TIERS.ram(
                ("llama_cpp.server", alias), self.checkpoint_settings.cache_max_bytes,
                self.checkpoint_settings.cache_max_tokens,
            )
        self.entry_floors[alias] = entry_floor_bytes(llama, self.checkpoint_settings.cache_min_tokens)
        # One disk tier for all models: its index is partitioned by model fingerprint.
        draft = None
        if self.draft_model is not None:
            draft = open_llama(self.draft_model, n_ctx=settings.n_ctx, n_batch=settings.n_batch,
                               n_ubatch=settings.n_ubatch, n_threads=settings.n_threads)
        if self.n_parallel > 1:
            self.parallel = ParallelLlama(llama, self.n_parallel, self.checkpoint_settings, cache=cache, disk=self._disk,
                                          draft=draft, n_draft=self.draft_n, unified=self.kv_unified)
            self._carry_counts(alias, self.parallel.manager)
            self.managers = {alias: self.parallel.manager}
            return llama
        manager = attach(llama, self.checkpoint_settings, cache=cache, disk=self._disk)
        self._carry_counts(alias, manager)
        if draft is not None:
            enable_speculative(llama, manager, draft, self.draft_n)
        self.managers = {alias: manager}
        return llama


    def _carry_counts(self, alias: str, manager: CheckpointManager) -> None:
        """Start ``manager``'s counters from those of the alias's previous manager, so that they stay monotonic
        across model switches (Prometheus counters restarting at every switch read as resets)."""
        self._unloaded.pop(alias, None)
        counts = self._counts.pop(alias, None)
        if counts:
            manager.counters.add(**counts)

    def model_stats(self) -> dict[str, dict[str, Any]]:
        """``stats()`` of every model loaded so far, by alias: the loaded one's live (``"loaded": True``), the others'
        as they were when the server switched away from them (``"loaded": False``)."""
        live = {name: {**manager.stats(), "loaded": True} for name, manager in dict(self.managers).items()}
        parallel = self.parallel
        for name, stats in live.items():
            stats["batching"] = None
            if parallel is not None and self.managers.get(name) is parallel.manager:
                stats["batching"] = parallel.scheduler.stats()
                if parallel.drafts is not None:
                    stats["batching"]["draft"] = parallel.drafts.lane.stats()
        return {**{name: stats for name, stats in dict(self._unloaded).items() if name not in live}, **live}


class RequestViews:
    """A parallel proxy as one request sees it: the views it hands out are closed when the request ends.

    A client that leaves mid-stream leaves its generation suspended; closing the view ends it and frees its slot at
    once (the host drops the generator without closing it, and a reference cycle can keep it alive).

    :param proxy: The server's proxy (with parallel slots).
    """

    def __init__(self, proxy: CheckpointLlamaProxy) -> None:
        self.proxy = proxy
        self._views: list[Any] = []

    def __call__(self, model: str | None = None) -> Any:
        view = self.proxy(model)
        self._views.append(view)
        return view

    def __iter__(self) -> Iterator[str]:
        return iter(self.proxy)

    def close(self) -> None:
        """End every generation the request left open."""
        views, self._views = self._views, []
        for view in views:
            view.close()
