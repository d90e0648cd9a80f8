"""Hook-level tests: plugins by entry point and by register(), arguments and order, veto, failing plugins."""

from __future__ import annotations

import textwrap
from typing import Any

import numpy as np
import pluggy
import pytest

import ckpt_plugin
from ckpt_plugin import PluginError, hookimpl
from ckpt_plugin.testing import HookRecorder, fake_manager, run_prompt


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
    assert created == [c.n_tokens for c in manager.slot.checkpoints] and created


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
        assert slot.n_tokens == end == manager.backend.pos_max() + 1
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
        assert slot.n_tokens == n_tokens == manager.backend.pos_max() + 1
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
    assert manager.slot.n_tokens == manager.backend.pos_max() + 1
    assert np.array_equal(manager.slot.tokens, prompt[: manager.slot.n_tokens])
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
    assert manager.slot.checkpoints == []


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
    assert not manager.backend.corrupted


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
    first = manager.checkpoint()
    assert seen.created == [first] and "on_checkpoint_created" not in manager.plugins.idle_hooks
    manager.plugins.unregister(name="seen")
    manager.checkpoint()
    assert seen.created == [first] and "on_checkpoint_created" in manager.plugins.idle_hooks
    manager.plugins.register(seen, name="seen")
    manager.plugins.set_blocked("seen")  # blocking unregisters
    manager.checkpoint()
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
    manager.hooks.call(other.hook.on_checkpoint_created, slot=manager.slot, checkpoint=first)
    assert elsewhere.created == [first]


def test_a_call_monitor_sees_hooks_nobody_implements() -> None:
    manager = fake_manager("recurrent", checkpoint_min_step=4)
    calls: list[str] = []
    undo = manager.plugins.add_hookcall_monitoring(lambda name, impls, kwargs: calls.append(name),
                                                   lambda outcome, name, impls, kwargs: None)
    manager.checkpoint()
    assert "on_checkpoint_created" in calls and not manager.plugins.idle_hooks
    undo()
    calls.clear()
    manager.checkpoint()
    assert calls == [] and "on_checkpoint_created" in manager.plugins.idle_hooks
