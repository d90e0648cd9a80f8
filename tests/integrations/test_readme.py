"""The README's Python examples run as written: on the built-in model, against a real ckpt-serve where they talk
to one (the only change: its address)."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re
from typing import Any

import pytest

from support.servers import model_args, run_server

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def python_blocks() -> dict[str, str]:
    """The README's ``python`` code blocks by the heading or sentence right before them."""
    text = README.read_text()
    blocks: dict[str, str] = {}
    for match in re.finditer(r"```python\n(.*?)```", text, re.S):
        before = text[: match.start()].rstrip().splitlines()
        blocks[before[-1] if before else ""] = match.group(1)
    return blocks


def block(title_part: str) -> str:
    found = [code for title, code in python_blocks().items() if title_part in title]
    assert len(found) == 1, (title_part, list(python_blocks()))
    return found[0]


def claimed_output() -> str:
    """What the README says the quick start prints (the line after "It prints")."""
    return re.search(r"It prints `([^`]*)`", README.read_text()).group(1)  # type: ignore[union-attr]


@pytest.mark.gemma
def test_the_quick_start_runs_as_written_and_restores_where_it_says() -> None:
    namespace: dict[str, Any] = {}
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(block("## Quick start"), "README.md (quick start)", "exec"), namespace)
        exec(compile(block("A plugin"), "README.md (a plugin)", "exec"), namespace)
    assert output.getvalue().splitlines() == [claimed_output()]
    stats = namespace["manager"].stats()
    assert stats["checkpoints_restored"] == 1 and stats["prompts"] == 2
    assert [type(plugin).__name__ for plugin in namespace["manager"].plugins.get_plugins()].count("RestoreLogger") == 1
    namespace["llama"].close()


@pytest.mark.gemma
def test_the_langchain_example_runs_as_written() -> None:
    namespace: dict[str, Any] = {}
    exec(compile(block("[outlines]`):"), "README.md (langchain)", "exec"), namespace)
    import ckpt_plugin

    assert ckpt_plugin.manager_of(namespace["llm"].client) is namespace["manager"]
    namespace["llm"].client.close()


def test_every_python_block_is_run_by_a_test() -> None:
    assert len(python_blocks()) == 4, list(python_blocks())


def test_talking_to_the_server_runs_against_ckpt_serve(tiny_model: Any) -> None:
    with run_server(model_args(tiny_model("llama"))) as server:
        code = block("### Talking to the server").replace("http://127.0.0.1:8000/v1", f"{server.url}/v1")
        output = io.StringIO()
        with contextlib.redirect_stdout(output):
            exec(compile(code, "README.md (talking to the server)", "exec"), {})
        printed = output.getvalue().split("\n")
        # The reply's text (whatever the tiny model says), then the cached token count.
        assert len(printed) >= 3 and printed[-1] == "" and int(printed[-2]) >= 0
