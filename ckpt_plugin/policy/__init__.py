"""Pure decisions: how a prompt is served (plan), where to pause and capture (schedule), what to evict (eviction), and
the measured rates and cost model (costs) with its record of plans (plan_record). Nothing here touches a model or a
store; memory kinds are ``ckpt_plugin.core.memory``'s."""

__all__: list[str] = []
