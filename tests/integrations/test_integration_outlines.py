"""outlines (``outlines.from_llamacpp``) with and without the plugin, through outlines' own API, on the tiny gemma3
model (32-token sliding window). outlines resets the ``Llama`` after every generation, so alone it evaluates every
prompt in full; with the plugin, the answers are a fresh context's and the shared prefixes are not evaluated again.
"""

from __future__ import annotations

import json
import pathlib
from typing import Callable

import pytest

pytest.importorskip("outlines", reason="outlines is not installed (pip install 'ckpt_plugin[outlines]')")

import outlines  # noqa: E402
from llama_cpp import Llama  # noqa: E402
from outlines.inputs import Chat  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from ckpt_plugin_integrations import outlines as ckpt_outlines  # noqa: E402

from support.library_runs import SYSTEM, Comparison, Message, Side, chat_with_edit, compare, words  # noqa: E402

SETTINGS = dict(checkpoint_min_step=16, load_entrypoints=False)
GREEDY = dict(temperature=0.0, top_k=1, repeat_penalty=1.0, seed=0)


class Animal(BaseModel):
    name: str
    legs: int


def load(path: pathlib.Path, with_plugin: bool) -> Llama:
    kwargs = ckpt_outlines.llama_kwargs(n_ctx=1024, n_batch=64)
    if not with_plugin:
        kwargs.pop("swa_full")  # the library alone is correct only with llama.cpp's default
    return Llama(str(path), n_threads=2, seed=0, verbose=False, **kwargs)


def outlines_sides(path: pathlib.Path, generate: Callable[[object, list[Message]], str],
                   chat_mode: bool) -> Comparison:
    def side(name: str) -> Side:
        llama = load(path, with_plugin=name == "plugin")
        if name == "plugin":
            model = ckpt_outlines.from_llamacpp(llama, chat_mode=chat_mode, **SETTINGS)
        else:
            model = outlines.from_llamacpp(llama, chat_mode=chat_mode)
        return Side(name, lambda messages: generate(model, messages), llama)

    return compare(side)


def chat(model: object, messages: list[Message]) -> str:
    return model(Chat([{"role": role, "content": content} for role, content in messages]),  # type: ignore[operator]
                 max_tokens=8, **GREEDY)


def test_chat_with_an_edit_matches_a_fresh_context_with_fewer_tokens(
    tiny_model: Callable[[str], pathlib.Path]
) -> None:
    comparison = outlines_sides(tiny_model("gemma3"), chat, chat_mode=True)
    chat_with_edit(comparison.ask)
    comparison.check("outlines chat")


def json_answer(model: object, messages: list[Message]) -> str:
    return model(messages[-1][1], Animal, max_tokens=24, **GREEDY)  # type: ignore[operator]


def test_structured_generation_over_inputs_sharing_a_long_prefix(tiny_model: Callable[[str], pathlib.Path]) -> None:
    comparison = outlines_sides(tiny_model("gemma3"), json_answer, chat_mode=False)
    for seed in range(20, 26):
        answer = comparison.ask([("user", f"{SYSTEM}\ninput: {words(12, seed)}\njson:")])
        assert answer.startswith('{"name":'), answer  # the schema constrains what the model writes
    comparison.check("outlines JSON")
    assert comparison.plugin.tokens_evaluated < comparison.plain.tokens_evaluated / 2


def test_a_complete_json_answer_parses(tiny_model: Callable[[str], pathlib.Path]) -> None:
    model = ckpt_outlines.from_llamacpp(load(tiny_model("llama"), True), chat_mode=False, **SETTINGS)
    generated = model("json:", outlines.types.JsonSchema(json.dumps({"type": "boolean"})), max_tokens=8, **GREEDY)
    assert json.loads(generated) in (True, False)
    assert ckpt_outlines.llama_of(model).n_batch == 64
    assert ckpt_outlines.detach(model) is not None
