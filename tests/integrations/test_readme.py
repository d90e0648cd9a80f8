"""The README's Python examples run as written: on a tiny model, against a real ckpt-serve where they talk to one."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re
from typing import Any

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


def test_the_quick_start_and_the_plugin_example_run(tiny_model: Any) -> None:
    path = tiny_model("gemma3")
    namespace: dict[str, Any] = {"prompt": "the cat sat on the mat " * 20, "edited_prompt": "the cat sat " * 30}
    quick_start = block("## Quick start").replace('"model.gguf"', repr(str(path)))
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(quick_start, "README.md (quick start)", "exec"), namespace)
        exec(compile(block("A plugin:"), "README.md (a plugin)", "exec"), namespace)
    stats = namespace["manager"].stats()
    assert stats["prompts"] >= 2 and stats["tokens_evaluated"] > 0
    assert "tokens_evaluated" in output.getvalue()  # the printed stats
    namespace["llama"].close()


def test_talking_to_the_server_runs_against_ckpt_serve(tiny_model: Any) -> None:
    with run_server(model_args(tiny_model("llama"))) as server:
        code = block("### Talking to the server").replace("http://127.0.0.1:8000/v1", f"{server.url}/v1")
        output = io.StringIO()
        with contextlib.redirect_stdout(output):
            exec(compile(code, "README.md (talking to the server)", "exec"), {})
        printed = output.getvalue().split("\n")
        # The reply's text (whatever the tiny model says), then the cached token count.
        assert len(printed) >= 3 and printed[-1] == "" and int(printed[-2]) >= 0
