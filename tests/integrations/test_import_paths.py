"""Every import path the docs show keeps working: each ``from ckpt_plugin... import ...`` line of the README and
docs/, and each dotted ``ckpt_plugin.x.y`` name they mention, resolves."""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# Names of plugins as registered (not modules), and entry-point groups.
NOT_MODULES = {"ckpt_plugin.default", "ckpt_plugin.draft", "ckpt_plugin.auto_attach", "ckpt_plugin.integrations"}


def _doc_imports() -> list[str]:
    lines = set()
    for path in DOCS:
        for match in re.finditer(r"^\s*(from ckpt_plugin[\w.]* import [\w, ]+)$", path.read_text(), re.MULTILINE):
            lines.add(match.group(1).strip().rstrip(","))
    return sorted(lines)


def _doc_names() -> list[str]:
    names = set()
    for path in DOCS:
        for match in re.finditer(r"`(ckpt_plugin(?:\.\w+)+)", path.read_text()):
            names.add(match.group(1))
    return sorted(names - NOT_MODULES)


@pytest.mark.parametrize("statement", _doc_imports())
def test_each_import_the_docs_show_runs(statement: str) -> None:
    exec(statement, {})


@pytest.mark.parametrize("dotted", _doc_names())
def test_each_name_the_docs_mention_resolves(dotted: str) -> None:
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[split:]:
            target = getattr(target, attribute)
        return
    pytest.fail(f"{dotted} names no module")


def test_the_public_face_exports_what_it_lists() -> None:
    import ckpt_plugin

    for name in ckpt_plugin.__all__:
        assert hasattr(ckpt_plugin, name), name
