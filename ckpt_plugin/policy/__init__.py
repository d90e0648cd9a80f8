"""Pure decisions: memory kinds and how a prompt is served (plan), where to pause and capture (schedule), what to
evict (eviction), and the measured rates and cost model (costs). Nothing here touches a model or a store."""

__all__: list[str] = []
