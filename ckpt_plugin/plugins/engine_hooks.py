"""Calls of the project's hooks for one manager, through pluggy's own callers (``plugins.hook.<name>``).

``hooks.call(hooks.hook.on_checkpoint_created, slot=..., checkpoint=...)`` binds ``manager``, skips the hooks nobody
implements without entering pluggy, and turns an implementation's exception into a
:class:`~ckpt_plugin.core.errors.PluginError` naming the plugin that raised it. There is no method per hook: the callers
are pluggy's, and what a hook returns is read where it is called.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import pluggy

from ckpt_plugin.core.errors import PluginError

if TYPE_CHECKING:
    from ckpt_plugin.plugins.view import EngineView

__all__ = ["EngineHooks", "ProjectPlugins"]


class ProjectPlugins(pluggy.PluginManager):
    """pluggy's plugin manager, keeping track of the hooks a call can skip: those without implementations, while no
    call monitor is installed (``add_hookcall_monitoring``, ``enable_tracing``: monitors see every call).

    :ivar idle_hooks: Hook name -> whether it is ``firstresult``, for every hook a call can skip; kept up to date by
        every registration, unregistration, new hook specification and monitor. Replaced whole, never changed in
        place, so that calls from the slots' threads read it without a lock.

    Changes (registrations, specifications, monitors) take turns under one lock, each with the recomputation of
    :attr:`idle_hooks` it causes: two plugins registered from two threads could otherwise leave the set computed
    before the second registration (a hook with an implementation skipped for good), or walk pluggy's hook
    namespace while the other adds to it.
    """

    def __init__(self, project_name: str) -> None:
        super().__init__(project_name)
        self.monitors = 0
        self.idle_hooks: dict[str, bool] = {}
        self._changing = threading.RLock()  # reentrant: pluggy's entry-point loading registers through register()

    def _hooks_changed(self) -> None:
        idle: dict[str, bool] = {}
        if not self.monitors:
            for name, caller in vars(self.hook).items():
                if isinstance(caller, pluggy.HookCaller) and not caller.get_hookimpls():
                    idle[name] = _is_firstresult(caller)
        self.idle_hooks = idle

    def register(self, plugin: object, name: str | None = None) -> str | None:
        with self._changing:
            try:
                return super().register(plugin, name)
            finally:
                self._hooks_changed()

    def unregister(self, plugin: object | None = None, name: str | None = None) -> Any:
        with self._changing:
            try:
                return super().unregister(plugin, name)
            finally:
                self._hooks_changed()

    def add_hookspecs(self, module_or_class: object) -> None:
        with self._changing:
            try:
                super().add_hookspecs(module_or_class)
            finally:
                self._hooks_changed()

    def add_hookcall_monitoring(self, before: Any, after: Any) -> Any:
        with self._changing:
            undo = super().add_hookcall_monitoring(before, after)
            self.monitors += 1
            self._hooks_changed()

        def undo_and_count() -> None:
            with self._changing:
                undo()
                self.monitors -= 1
                self._hooks_changed()

        return undo_and_count


class EngineHooks:
    """The hooks of ``manager``'s plugin manager, called with ``manager`` bound.

    :ivar hook: The plugin manager's hook callers (``plugins.hook``).
    """

    def __init__(self, plugins: pluggy.PluginManager, manager: EngineView) -> None:
        self._plugins = plugins
        self.hook = plugins.hook
        self._manager = manager

    def call(self, caller: pluggy.HookCaller, **kwargs: Any) -> Any:
        """Call ``caller`` (any hook, a plugin's own included) with ``manager`` bound; wraps plugin errors.

        A hook nobody implements returns what pluggy would (``None`` for a ``firstresult`` hook, else ``[]``) without
        going through pluggy: every checkpoint fires three hooks that usually have no implementation, right after
        a state copy that left the CPU caches cold, where pluggy's argument checks and call loop cost tens of
        microseconds. Unless a call monitor is installed: monitors see every call. :class:`ProjectPlugins` keeps the
        hooks that can be skipped; with another plugin manager every call goes through pluggy.
        """
        firstresult = getattr(self._plugins, "idle_hooks", _NONE_IDLE).get(caller.name)
        if firstresult is not None and caller is getattr(self.hook, caller.name, None):  # this manager's own hook
            return None if firstresult else []
        try:
            return caller(manager=self._manager, **kwargs)
        except PluginError:
            raise
        except Exception as exc:
            raise PluginError(culprit(caller, exc), caller.name, exc) from exc


_NONE_IDLE: dict[str, bool] = {}


def _is_firstresult(caller: pluggy.HookCaller) -> bool:
    return caller.spec is not None and bool(caller.spec.opts.get("firstresult", False))


def culprit(caller: pluggy.HookCaller, exc: BaseException) -> str:
    """The name of the plugin whose implementation raised ``exc`` (the first of their frames in the traceback)."""
    owners = {}
    for impl in caller.get_hookimpls():
        code = getattr(impl.function, "__code__", None)
        if code is not None:
            owners[code] = impl.plugin_name
    tb = exc.__traceback__
    while tb is not None:
        name = owners.get(tb.tb_frame.f_code)
        if name is not None:
            return name
        tb = tb.tb_next
    return "<unknown>"
