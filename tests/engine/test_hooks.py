"""Hook-level tests: plugins by entry point and by register(), arguments and order, veto, failing plugins."""

from __future__ import annotations

import textwrap
from typing import Any

import numpy as np
import pluggy
import pytest

import ckpt_plugin
from ckpt_plugin import PluginError, hookimpl
from ckpt_plugin.testing import HookRecorder, fake_manager, namespace_for, run_prompt


def write_entrypoint_plugin(root: Any) -> None:
    (root / "third_party_ckpt.py").write_text(textwrap.dedent("""
        from ckpt_plugin import hookimpl
        seen = []

        @hookimpl
        def on_attach(manager):
            seen.append(("on_attach", manager))

        @hookimpl
        def on_checkpoint_created(manager, slot, checkpoint):
            seen.append(("on_checkpoint_created", checkpoint.n_tokens))
    """))
    dist = root / "third_party_ckpt-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: third-party-ckpt\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[ckpt_plugin]\nthird_party = third_party_ckpt\n")


def test_entry_point_plugin_is_loaded_and_sees_hooks(make_llama: Any, tmp_path: Any, monkeypatch: Any) -> None:
    write_entrypoint_plugin(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import third_party_ckpt  # type: ignore[import-not-found]

    llama = make_llama("gemma3")
    manager = ckpt_plugin.attach(llama, checkpoint_min_step=16)
    assert manager.plugins.get_plugin("third_party") is third_party_ckpt
    llama.create_completion(list(range(3, 60)), max_tokens=2, temperature=0)
    assert third_party_ckpt.seen[0] == ("on_attach", manager)
    created = [n for name, n in third_party_ckpt.seen[1:] if name == "on_checkpoint_created"]
    assert created == [c.n_tokens for c in manager.primary.slot.checkpoints] and created


def test_entry_points_can_be_turned_off(make_llama: Any, tmp_path: Any, monkeypatch: Any) -> None:
    write_entrypoint_plugin(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    manager = ckpt_plugin.attach(make_llama("llama"), load_entrypoints=False)
    assert manager.plugins.get_plugin("third_party") is None


class Observer:
    """Checks the documented invariants while the hooks are called."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    @hookimpl
    def on_prompt_processed(self, manager: Any, slot: Any, start: int, end: int, prompt_end: int) -> None:
        assert 0 <= start < end <= prompt_end
        assert slot.n_tokens == end == manager.primary.backend.pos_max() + 1
        self.events.append(("processed", (start, end, prompt_end)))

    @hookimpl
    def on_checkpoint_created(self, manager: Any, slot: Any, checkpoint: Any) -> None:
        assert checkpoint is slot.checkpoints[-1] and checkpoint.n_tokens == slot.n_tokens
        assert not checkpoint.target.flags.writeable
        self.events.append(("created", checkpoint.n_tokens))

    @hookimpl
    def on_cache_alloc(self, manager: Any, namespace: str, n_tokens: int, n_bytes: int) -> None:
        assert n_bytes > 0 and n_tokens > 0
        self.events.append(("alloc", n_tokens))

    @hookimpl
    def on_cache_hit(self, manager: Any, slot: Any, entry: Any, n_tokens: int) -> None:
        self.events.append(("hit", n_tokens))

    @hookimpl
    def on_slot_restore(self, manager: Any, slot: Any, checkpoint: Any, entry: Any, n_tokens: int) -> None:
        assert slot.n_tokens == n_tokens == manager.primary.backend.pos_max() + 1
        self.events.append(("restore", n_tokens))


def test_registered_plugin_sees_hooks_in_order_with_documented_arguments(make_llama: Any) -> None:
    llama = make_llama("mamba")
    manager = ckpt_plugin.attach(llama, checkpoint_min_step=16, load_entrypoints=False)
    observer = Observer()
    manager.plugins.register(observer, name="observer")
    a = [1, *range(3, 50)]
    b = [1, *range(100, 140)]
    llama.create_completion(a, max_tokens=3, temperature=0)
    llama.create_completion(b, max_tokens=3, temperature=0)
    llama.create_completion(a + [7, 8], max_tokens=3, temperature=0)
    names = [name for name, _ in observer.events]
    # first prompt: spans processed, checkpoints at 16, 32 and one before the end (47)
    assert observer.events[:6] == [
        ("processed", (0, 16, 48)), ("created", 16), ("processed", (16, 32, 48)), ("created", 32),
        ("processed", (32, 47, 48)), ("created", 47),
    ]
    # switching conversations saves the first into the cache; coming back hits it and restores it
    assert names.index("alloc") < names.index("hit") < names.index("restore")
    # mamba: the checkpoint one token before the end of ``a`` serves the prompt that extends ``a``
    assert ("hit", 47) in observer.events and ("restore", 47) in observer.events


class Veto:
    @hookimpl
    def on_cache_alloc(self, manager: Any, namespace: str, n_tokens: int, n_bytes: int) -> bool:
        return False


def test_veto_in_on_cache_alloc_keeps_entries_out() -> None:
    manager = fake_manager("swa")
    manager.plugins.register(Veto())
    run_prompt(manager, list(range(100)), 2)
    run_prompt(manager, list(range(500, 600)), 2)
    assert len(manager.cache) == 0 and manager.counters.cache_saves == 0


class Failing:
    @hookimpl
    def on_checkpoint_created(self, manager: Any, slot: Any, checkpoint: Any) -> None:
        raise RuntimeError("boom")


def test_failing_plugin_gives_clear_error_and_consistent_slot(make_llama: Any) -> None:
    llama = make_llama("gemma3")
    reference = make_llama("gemma3")
    manager = ckpt_plugin.attach(llama, checkpoint_min_step=16, load_entrypoints=False)
    manager.plugins.register(Failing(), name="failing-plugin")
    prompt = [1, *range(3, 80)]
    with pytest.raises(PluginError, match="failing-plugin.*on_checkpoint_created.*boom") as info:
        llama.create_completion(prompt, max_tokens=3, temperature=0)
    assert info.value.plugin == "failing-plugin"
    assert manager.primary.slot.n_tokens == manager.primary.backend.pos_max() + 1
    assert np.array_equal(manager.primary.slot.tokens, prompt[: manager.primary.slot.n_tokens])
    manager.plugins.unregister(name="failing-plugin")
    got = llama.create_completion(prompt, max_tokens=6, temperature=0)["choices"][0]["text"]
    want = reference.create_completion(prompt, max_tokens=6, temperature=0)["choices"][0]["text"]
    assert got == want


def test_policy_can_be_replaced_by_a_plugin() -> None:
    class Never:
        @hookimpl
        def checkpoint_wanted(self, manager: Any, slot: Any, position: int, prompt_end: int) -> bool:
            return False

    manager = fake_manager("recurrent", checkpoint_min_step=4)
    manager.plugins.register(Never())
    run_prompt(manager, list(range(50)))
    assert manager.primary.slot.checkpoints == []


def test_hook_recorder_from_the_testing_kit(hook_recorder: HookRecorder) -> None:
    manager = fake_manager("hybrid", checkpoint_min_step=8)
    hook_recorder.watch(manager)
    run_prompt(manager, list(range(40)), 3)
    run_prompt(manager, list(range(20)) + [99], 3)
    names = hook_recorder.names()
    assert names[0] == "on_prompt_processed" and "on_checkpoint_created" in names
    assert "checkpoint_wanted" in names  # decisions are recorded too
    created = [kwargs for name, kwargs in hook_recorder.calls if name == "on_checkpoint_created"]
    assert created[0]["checkpoint"].n_tokens > 0 and created[0]["manager"] is manager
    assert "on_slot_restore" in names
    assert not manager.primary.backend.corrupted


def test_a_skipped_hook_is_called_as_soon_as_a_plugin_implements_it_and_skipped_again_after() -> None:
    manager = fake_manager("recurrent", checkpoint_min_step=4)
    run_prompt(manager, list(range(3, 30)))
    assert "on_checkpoint_created" in manager.plugins.idle_hooks

    class Seen:
        def __init__(self) -> None:
            self.created: list[Any] = []

        @hookimpl
        def on_checkpoint_created(self, manager: Any, slot: Any, checkpoint: Any) -> None:
            self.created.append(checkpoint)

    seen = Seen()
    manager.plugins.register(seen, name="seen")
    first = manager.primary.checkpoint()
    assert seen.created == [first] and "on_checkpoint_created" not in manager.plugins.idle_hooks
    manager.plugins.unregister(name="seen")
    manager.primary.checkpoint()
    assert seen.created == [first] and "on_checkpoint_created" in manager.plugins.idle_hooks
    manager.plugins.register(seen, name="seen")
    manager.plugins.set_blocked("seen")  # blocking unregisters
    manager.primary.checkpoint()
    assert seen.created == [first]

    # A plugin's own hook, specified after the manager was made and implemented later still.
    class Spec:
        @ckpt_plugin.hookspec
        def on_my_event(self, manager: Any) -> int:  # type: ignore[empty-body]
            """A third party's hook."""

    class Impl:
        @hookimpl
        def on_my_event(self, manager: Any) -> int:
            return 5

    manager.plugins.add_hookspecs(Spec)
    assert manager.hooks.call(manager.plugins.hook.on_my_event) == []
    manager.plugins.register(Impl())
    assert manager.hooks.call(manager.plugins.hook.on_my_event) == [5]

    # Only this manager's own callers are skipped: another plugin manager's hook of the same name is called.
    assert "on_checkpoint_created" in manager.plugins.idle_hooks
    other = pluggy.PluginManager(ckpt_plugin.PROJECT_NAME)
    other.add_hookspecs(ckpt_plugin.plugins.hookspecs)
    other.register(Seen(), name="seen-elsewhere")
    elsewhere = other.get_plugin("seen-elsewhere")
    manager.hooks.call(other.hook.on_checkpoint_created, slot=manager.primary.slot, checkpoint=first)
    assert elsewhere.created == [first]


def test_a_call_monitor_sees_hooks_nobody_implements() -> None:
    manager = fake_manager("recurrent", checkpoint_min_step=4)
    calls: list[str] = []
    undo = manager.plugins.add_hookcall_monitoring(lambda name, impls, kwargs: calls.append(name),
                                                   lambda outcome, name, impls, kwargs: None)
    manager.primary.checkpoint()
    assert "on_checkpoint_created" in calls and not manager.plugins.idle_hooks
    undo()
    calls.clear()
    manager.primary.checkpoint()
    assert calls == [] and "on_checkpoint_created" in manager.plugins.idle_hooks


def test_fake_manager_loads_no_entry_points_unless_asked(tmp_path: Any, monkeypatch: Any) -> None:
    """docs/hooks.md, "Testing kit": a test sees only the plugins it registers, unless it asks for the installed
    ones (a plugin tested through its own entry point)."""
    write_entrypoint_plugin(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import third_party_ckpt  # type: ignore[import-not-found]

    assert fake_manager().plugins.get_plugin("third_party") is None
    assert fake_manager(load_entrypoints=True).plugins.get_plugin("third_party") is third_party_ckpt


def test_namespace_for_is_the_namespace_the_server_derives() -> None:
    from starlette.datastructures import Headers

    from ckpt_plugin.config import ServeSettings
    from ckpt_plugin.http.tenants import Tenants

    by_key = Tenants(ServeSettings(namespaces="api_key"), api_key=None)
    by_header = Tenants(ServeSettings(namespaces="header", namespace_header="x-tenant"), api_key=None)
    assert namespace_for("api_key", "sk-tenant-a") == "key:43b53901e1469bd7"  # docs/server.md, "Namespaces"
    assert by_key.caller(Headers({"authorization": "Bearer sk-tenant-a"})).namespace == "key:43b53901e1469bd7"
    assert by_header.caller(Headers({"x-tenant": "acme"})).namespace == namespace_for("header", "acme")
    assert by_key.caller(Headers({})).namespace == namespace_for("api_key", None) == "key:anonymous"
    with pytest.raises(ValueError, match="derives no namespace"):
        namespace_for("off", "x")


class TenantRule:
    """A tenant rule under test: one tenant's conversations are never cached."""

    def __init__(self, uncached: str) -> None:
        self.uncached = uncached
        self.asked: list[str] = []

    @hookimpl
    def on_cache_alloc(self, manager: Any, namespace: str, n_tokens: int, n_bytes: int) -> bool | None:
        self.asked.append(namespace)
        return False if namespace == self.uncached else None


def test_run_prompt_serves_a_prompt_in_a_tenants_namespace() -> None:
    """``run_prompt(..., namespace=...)`` serves as a request of that tenant does, so a tenant rule is tested
    without the request scope of the HTTP layer."""
    alice, bob = namespace_for("api_key", "sk-alice"), namespace_for("api_key", "sk-bob")
    manager = fake_manager("plain", cache_min_tokens=8)
    rule = TenantRule(uncached=alice)
    manager.plugins.register(rule)
    prompt = list(range(100, 140))
    run_prompt(manager, prompt, namespace=alice)
    assert manager.primary.slot.namespace == alice
    run_prompt(manager, prompt, namespace=bob)  # the slot changes tenant: alice's state would be parked
    run_prompt(manager, prompt[:30], namespace="other")  # and bob's
    assert rule.asked[:2] == [alice, bob]
    assert {entry.namespace for entry in manager.cache.entries()} == {bob}
    assert run_prompt(manager, prompt, namespace=bob) < len(prompt)  # bob's own state comes back
    run_prompt(manager, prompt)
    assert manager.primary.slot.namespace == manager.settings.namespace == "default"  # outside a tenant


def test_the_tenant_rule_example_of_the_docs_runs() -> None:
    """docs/hooks.md, "Namespaces (tenants)": its example, run as written."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "hooks.md").read_text()
    section = text[text.index("### Namespaces (tenants)"):]
    namespace: dict[str, Any] = {}
    exec(compile(re.search(r"```python\n(.*?)```", section, re.S).group(1), "docs/hooks.md", "exec"), namespace)
    namespace["test_trial_keys_are_never_cached"](fake_manager)
