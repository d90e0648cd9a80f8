"""Every public name has one home: each module of ckpt_plugin (but the testing kit and private ``_`` modules) says
what it exports in ``__all__``, every name listed there exists, and the import paths earlier releases documented
(``ckpt_plugin.checkpoint``, ``.config``, ...) re-export names, never the modules their homes happen to import."""

from __future__ import annotations

import ast
import importlib
import pathlib
import types

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "ckpt_plugin"
# The import paths earlier releases documented, each re-exporting its module (docs/design.md, "Modules and the
# request flow").
COMPATIBILITY = ["admission", "checkpoint", "config", "hooks", "middleware", "speculative"]


def _module_names() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if len(parts) > 1 and parts[1] == "testing":
            continue
        if any(part.startswith("_") for part in parts):
            continue
        names.append(".".join(parts))
    return names


def _source(module: str) -> pathlib.Path:
    path = PACKAGE.parent.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _declares_all(module: str) -> bool:
    """Whether the module's source assigns ``__all__`` at its top level."""
    for node in ast.parse(_source(module).read_text()).body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        if any(isinstance(target, ast.Name) and target.id == "__all__" for target in targets):
            return True
    return False


def _import(module: str) -> types.ModuleType:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:  # an optional dependency (llama-cpp-python, redis) not installed
        if error.name and error.name.split(".")[0] != "ckpt_plugin":
            pytest.skip(f"{module} needs {error.name}")
        raise


def test_the_modules_are_found() -> None:
    modules = _module_names()
    assert "ckpt_plugin" in modules and "ckpt_plugin.policy.plan" in modules
    assert not any(name.startswith("ckpt_plugin.testing") for name in modules)


@pytest.mark.parametrize("module", _module_names())
def test_each_module_declares_all(module: str) -> None:
    assert _declares_all(module), f"{module} declares no __all__"


@pytest.mark.parametrize("module", _module_names())
def test_each_name_in_all_exists(module: str) -> None:
    imported = _import(module)
    missing = [name for name in imported.__all__ if not hasattr(imported, name)]
    assert not missing, f"{module}.__all__ names what it does not have: {missing}"
    assert len(imported.__all__) == len(set(imported.__all__)), f"{module}.__all__ lists a name twice"


@pytest.mark.parametrize("name", COMPATIBILITY)
def test_compatibility_modules_export_names_not_modules(name: str) -> None:
    imported = _import(f"ckpt_plugin.{name}")
    assert imported.__all__, f"ckpt_plugin.{name} exports nothing"
    modules = [item for item in imported.__all__ if isinstance(getattr(imported, item), types.ModuleType)]
    assert not modules, f"ckpt_plugin.{name}.__all__ lists modules: {modules}"
    star: dict[str, object] = {}
    exec(f"from ckpt_plugin.{name} import *", star)
    assert not [key for key, value in star.items() if isinstance(value, types.ModuleType)]
    assert {"np", "mmap", "weakref"}.isdisjoint(star)
