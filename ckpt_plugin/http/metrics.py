"""Prometheus metrics of checkpoint managers, through ``prometheus-client``.

Counters and gauges are read from :meth:`CheckpointManager.stats` at scrape time (a custom collector, so nothing is
counted twice); the restore latency histogram is fed by a plugin observing ``on_slot_restore``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from ckpt_plugin.core.counters import REUSE_SOURCES
from ckpt_plugin.plugins.hookspecs import hookimpl
from ckpt_plugin.engine.manager import CheckpointManager

__all__ = ["CONTENT_TYPE", "Metrics", "ModelStats", "SharedTierCollector", "live_stats"]

ModelStats = Callable[[], Mapping[str, Mapping[str, Any]]]
"""Returns ``stats()`` by model name: the live managers', and those a server keeps for models it has unloaded."""

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

REUSE_HELP = ("Prompt tokens served without evaluation, by where they came from: slot (the slot's own memory and "
              "checkpoints, the usual case of a next turn), cache (the RAM prompt cache: conversations that had left "
              "the slot), disk (the disk tier), shared (the shared tier)")
"""HELP of ``ckpt_prompt_tokens_reused_total``, the headline counter (label ``source``, :data:`REUSE_SOURCES`)."""

COUNTERS = {
    "prompt_tokens": "Prompt tokens the model was asked to serve (reused plus evaluated)",
    "prompts": "Prompts served",
    "tokens_evaluated": "Prompt and generated tokens evaluated by the model",
    "tokens_reused": "Prompt tokens served without evaluation, from any source (the sum of "
                     "ckpt_prompt_tokens_reused_total over its sources)",
    "cache_hits": "Prompts served from a prompt-cache entry: a conversation that had left the slot (a next turn "
                  "served by the slot itself is no cache hit: ckpt_prompt_tokens_reused_total{source=\"slot\"})",
    "cache_misses": "Prompts the slot's memory could not serve to their end (a next turn with new text is one) and "
                    "no cache entry served",
    "cache_saves": "Entries put into the prompt cache",
    "cache_evictions": "Entries evicted for the budget",
    "checkpoints_created": "Checkpoints taken",
    "checkpoints_restored": "Checkpoints restored",
    "checkpoints_erased": "Checkpoints dropped from slots",
    "forced_reprocess": "Prompts whose shared prefix could not be reused",
    "tokens_reprocessed": "Shared prompt tokens evaluated again",
    "capture_failures": "State captures that failed (no checkpoint taken)",
    "bytes_copied": "State bytes copied by llama.cpp get/set calls",
    "disk_hits": "Prompts served from a disk-tier entry",
    "corrupt_files": "Slot and disk-tier files that failed validation (refused; disk-tier ones moved aside)",
    "stood_aside": "Generations served as the host alone would: the memory held positions written outside the "
                   "engine (image embeddings, a direct llama_decode) that no token id names",
    "outside_writes_dropped": "Times positions written outside the engine were dropped before serving a prompt",
    "media_chunks": "Media chunks (images, audio) encoded by the multimodal projector and decoded (a follow-up about "
                    "an image the memory or a store holds adds none)",
    "media_positions": "Positions those media chunks filled (counted in ckpt_tokens_evaluated_total too)",
    "pages_stored": "Pages of captured states copied out of them (cells no live state held yet)",
    "pages_shared": "Pages of captured states found live and referenced instead of copied",
    "page_bytes_stored": "Bytes of the pages copied out of captured states",
    "page_bytes_shared": "Bytes of the pages referenced instead of copied",
    "states_kept_whole": "Captured states kept as one blob (a layout the pager does not know)",
}
SHARED_COUNTERS = {
    "hits": "Prompts served from a shared-tier entry",
    "misses": "Shared-tier lookups that found no stored prefix of the prompt",
    "lookups": "Shared-tier lookups (prompts whose prefix the local tiers could not fully serve)",
    "errors": "Shared-tier commands that failed (unreachable, timed out, refused)",
    "corrupt": "Shared-tier values that failed validation (dropped)",
    "incomplete": "Shared-tier entries whose blobs the server had evicted",
    "bytes_read": "Bytes read from the shared tier",
    "bytes_written": "Bytes written to the shared tier",
    "writes": "Entries written to the shared tier",
    "write_errors": "Shared-tier writes that failed",
    "write_drops": "Entries not written to the shared tier: queue full or server unavailable",
    "round_trips": "Round trips to the shared-tier server on the request path (lookups and fetches)",
    "write_round_trips": "Round trips to the shared-tier server of the write-behind thread",
    "pages_written": "Pages written to the shared tier (the server lacked them)",
    "pages_present": "Pages an entry names that the shared tier held already (not written again)",
    "pages_read": "Pages read from the shared tier on fetches",
    "pages_held": "Pages a fetch found live in this process instead of reading them",
}
SHARED_GAUGES = {
    "queue_depth": "Entries waiting to be written to the shared tier",
    "available": "1 while the shared-tier server answers, 0 while it is probed",
}
GAUGES = {
    "resident_bytes": "Bytes of unique state buffers held by slots and the cache",
    "referenced_bytes": "Bytes the same references would hold as copies",
    "sharing_ratio": "referenced_bytes / resident_bytes: holders a stored byte serves on average",
    "live_pages": "Pages of paged states alive in the process",
    "live_page_bytes": "Bytes of the pages alive in the process, each counted once",
    "state_bytes": "State bytes the budget covers: entries, slot checkpoints and recycled buffers",
    "state_budget_bytes": "The state byte budget (--cache-max-bytes)",
    "pool_free_bytes": "Bytes of freed state buffers kept mapped for the next capture",
    "cache_entries": "Prompt-cache entries",
    "cache_tokens": "Tokens held by prompt-cache entries",
    "disk_entries": "Entries in the disk tier",
    "disk_bytes": "Bytes of the disk tier's files",
}


def live_stats(managers: Callable[[], Mapping[str, CheckpointManager]]) -> ModelStats:
    """``stats()`` of the managers ``managers()`` returns, by model."""
    return lambda: {model: manager.stats() for model, manager in dict(managers()).items()}


class ManagerCollector:
    """Collects the stats of the managers ``managers()`` returns, labelled by model.

    :param managers: Returns the managers by model (read for their ``stats()`` unless ``stats`` is given).
    :param stats: Returns the stats by model directly (a server that keeps the counters of unloaded models).
    """

    def __init__(self, managers: Callable[[], Mapping[str, CheckpointManager]],
                 stats: ModelStats | None = None) -> None:
        self._stats = stats or live_stats(managers)

    def collect(self) -> Iterator[Metric]:
        stats = dict(self._stats())
        reused = CounterMetricFamily("ckpt_prompt_tokens_reused", REUSE_HELP, labels=["model", "source"])
        for model, values in stats.items():
            for source in REUSE_SOURCES:
                reused.add_metric([model, source], float(values[f"tokens_reused_from_{source}"]))
        yield reused
        plugins = GaugeMetricFamily("ckpt_plugin_loaded", "1 for each plugin registered with the model's manager "
                                    "(entry points of the 'ckpt_plugin' group, manager.plugins.register)",
                                    labels=["model", "plugin"])
        for model, values in stats.items():
            for plugin in values.get("plugins", ()):
                plugins.add_metric([model, plugin], 1.0)
        yield plugins
        for name, doc in COUNTERS.items():
            family = CounterMetricFamily(f"ckpt_{name}", doc, labels=["model"])
            for model, values in stats.items():
                family.add_metric([model], float(values[name]))
            yield family
        for name, doc in GAUGES.items():
            family = GaugeMetricFamily(f"ckpt_{name}", doc, labels=["model"])
            for model, values in stats.items():
                family.add_metric([model], float(values[name]))
            yield family


SLOT_GAUGES: dict[str, str] = {
    "busy": "1 while a request holds the slot",
    "tokens": "Tokens the slot's memory holds",
    "checkpoints": "Checkpoints the slot holds",
}


class SlotCollector:
    """Per-slot gauges of the managers ``managers()`` returns, labelled by model and slot id (the parallel slots
    of ``ckpt-serve --parallel``; a single attached ``Llama`` has slot 0)."""

    def __init__(self, managers: Callable[[], Mapping[str, CheckpointManager]]) -> None:
        self._managers = managers

    def collect(self) -> Iterator[Metric]:
        rows = [
            (model, controller) for model, manager in dict(self._managers()).items() for controller in manager.controllers
        ]
        values = {
            "busy": lambda controller: float(controller.busy),
            "tokens": lambda controller: float(controller.slot.n_tokens),
            "checkpoints": lambda controller: float(len(list(controller.slot.checkpoints))),
        }
        for name, doc in SLOT_GAUGES.items():
            family = GaugeMetricFamily(f"ckpt_slot_{name}", doc, labels=["model", "slot"])
            for model, controller in rows:
                family.add_metric([model, str(controller.slot.id)], values[name](controller))
            yield family


class SharedTierCollector:
    """Collects the counters, gauges and latencies of the shared tiers of the managers ``managers()`` returns,
    labelled by server (its URL without credentials)."""

    def __init__(self, managers: Callable[[], Mapping[str, CheckpointManager]]) -> None:
        self._managers = managers

    def collect(self) -> Iterator[Metric]:
        tiers = {id(m.store.shared): m.store.shared for m in self._managers().values() if m.store.shared is not None}
        stats = [tier.stats() for tier in tiers.values()]
        if not stats:
            return
        scalars = [(CounterMetricFamily, SHARED_COUNTERS.items()), (GaugeMetricFamily, SHARED_GAUGES.items())]
        for family_type, names in scalars:
            for name, doc in names:
                family = family_type(f"ckpt_shared_{name}", doc, labels=["server"])
                for values in stats:
                    family.add_metric([values["url"]], float(values[name]))
                yield family
        # Each tier's prometheus_client histograms, one family per name over every server.
        for attribute in ("lookup_histogram", "fetch_histogram"):
            merged: Metric | None = None
            for tier in tiers.values():
                for metric in getattr(tier, attribute).collect():
                    if merged is None:
                        merged = metric
                    else:
                        merged.samples.extend(metric.samples)
            if merged is not None:
                yield merged


COST_COUNTERS = {  # metric name: (key of CostModel.snapshot(), help)
    "plans": ("plans", "Plans carried out with an estimate of their time"),
    "plans_by_cost": ("plans_by_cost", "Plans that kept fewer tokens than they could because that was clearly faster"),
    "tokens_recomputed_by_cost": ("tokens_recomputed_by_cost",
                                  "Prompt tokens evaluated although a restore could have served them (it was slower)"),
    "fetches_skipped_by_cost": ("fetches_skipped_by_cost",
                                "Candidates of slower tiers not fetched because they could not be faster"),
    "lookups_skipped_by_cost": ("lookups_skipped_by_cost",
                                "Shared-tier lookups not made because even a hit could not be faster"),
    "plan_estimated_seconds": ("estimated_seconds",
                               "Estimated seconds of the plans (fetch, restore, evaluation of the rest of the prompt)"),
    "plan_actual_seconds": ("actual_seconds", "Measured seconds of the same plans"),
}


class CostCollector:
    """Collects each manager's measured rates and its plans' estimated against actual time, labelled by model."""

    def __init__(self, managers: Callable[[], Mapping[str, CheckpointManager]]) -> None:
        self._managers = managers

    def collect(self) -> Iterator[Metric]:
        models = {model: manager.rules.costs for model, manager in self._managers().items()}
        views = {model: costs.snapshot() for model, costs in models.items()}
        eval_rate = GaugeMetricFamily("ckpt_eval_seconds_per_token", "Measured seconds per evaluated token, by the "
                                      "smallest batch size of its bucket", labels=["model", "batch"])
        latency = GaugeMetricFamily("ckpt_transfer_latency_seconds", "Measured fixed cost of one state transfer "
                                    "(ram: restore into the context; capture; disk read; shared: round trip)",
                                    labels=["model", "tier"])
        bandwidth = GaugeMetricFamily("ckpt_transfer_bytes_per_second", "Measured bandwidth of state transfers",
                                      labels=["model", "tier"])
        for model, view in views.items():
            for batch, seconds in view["eval_seconds_per_token"].items():
                if seconds is not None:  # a batch size never measured has no rate of its own
                    eval_rate.add_metric([model, batch], seconds)
            for tier, rate in view["transfers"].items():
                latency.add_metric([model, tier], rate["latency_seconds"])
                bandwidth.add_metric([model, tier], rate["bytes_per_second"])
        yield from (eval_rate, latency, bandwidth)
        for name, (key, doc) in COST_COUNTERS.items():
            family = CounterMetricFamily(f"ckpt_{name}", doc, labels=["model"])
            for model, view in views.items():
                family.add_metric([model], float(view[key]))
            yield family
        ratio = HistogramMetricFamily("ckpt_plan_time_ratio", "Actual / estimated time of each plan (its fetches, "
                                      "restore and the evaluation of the rest of the prompt)", labels=["model"])
        for model, costs in models.items():
            buckets, _, total = costs.plan_record.ratio_histogram()
            ratio.add_metric([model], [("+Inf" if bound == float("inf") else str(bound), count)
                                       for bound, count in buckets], total)
        yield ratio


class RestoreLatency:
    """A plugin recording restore latency into a histogram."""

    def __init__(self, histogram: Histogram, model: str) -> None:
        self._observe = histogram.labels(model=model).observe

    @hookimpl
    def on_slot_restore(self, manager: CheckpointManager, slot: Any, checkpoint: object, entry: object,
                        n_tokens: int) -> None:
        self._observe(manager.controllers[slot.id].last_restore_seconds)


class Metrics:
    """A registry for the managers of one server.

    :param managers: Returns the current managers by model name.
    :param stats: Returns the stats by model (:class:`ManagerCollector`); by default the current managers'.
    """

    def __init__(self, managers: Callable[[], Mapping[str, CheckpointManager]],
                 stats: ModelStats | None = None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(ManagerCollector(managers, stats))
        self.registry.register(SharedTierCollector(managers))
        self.registry.register(CostCollector(managers))
        self.registry.register(SlotCollector(managers))
        self.restore_seconds = Histogram(
            "ckpt_restore_seconds", "Time to restore a checkpoint or cache entry", ["model"],
            registry=self.registry, buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
        )

    def watch(self, model: str, manager: CheckpointManager) -> None:
        """Record ``manager``'s restore latencies under ``model``."""
        manager.plugins.register(RestoreLatency(self.restore_seconds, model), name="ckpt_plugin.http.metrics")

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
