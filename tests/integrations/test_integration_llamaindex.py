"""LlamaIndex (``llama-index-llms-llama-cpp``'s ``LlamaCPP``) with and without the plugin, through LlamaIndex's own
API, on the tiny gemma3 model (32-token sliding window): same answers as a fresh context, fewer tokens evaluated
than LlamaIndex alone."""

from __future__ import annotations

import pathlib
from typing import Callable

import pytest

pytest.importorskip("llama_index.llms.llama_cpp",
                    reason="LlamaIndex's llama.cpp LLM is not installed (pip install 'ckpt_plugin[llamaindex]')")

from llama_index.core.llms import ChatMessage  # noqa: E402
from llama_index.llms.llama_cpp import LlamaCPP  # noqa: E402

from ckpt_plugin_integrations import llamaindex as ckpt_llamaindex  # noqa: E402

from support.library_runs import Message, Side, chat_with_edit, compare  # noqa: E402

SETTINGS = dict(checkpoint_min_step=16, load_entrypoints=False)


def chat_side(name: str, path: pathlib.Path, streaming: bool) -> Side:
    kwargs = ckpt_llamaindex.model_kwargs(n_ctx=1024, n_batch=64, seed=0, n_threads=2)
    if name != "plugin":
        kwargs["model_kwargs"].pop("swa_full")  # the library alone is correct only with llama.cpp's default
    llm = LlamaCPP(model_path=str(path), temperature=0.0, max_new_tokens=8, verbose=False,
                   generate_kwargs={"top_k": 1, "repeat_penalty": 1.0}, **kwargs)
    if name == "plugin":
        ckpt_llamaindex.attach(llm, **SETTINGS)

    def ask(messages: list[Message]) -> str:
        chat = [ChatMessage(role=role, content=content) for role, content in messages]
        if streaming:
            return "".join(part.delta or "" for part in llm.stream_chat(chat))
        return str(llm.chat(chat).message.content)

    return Side(name, ask, ckpt_llamaindex.llama_of(llm))


@pytest.mark.parametrize("streaming", [False, True], ids=["chat", "stream_chat"])
def test_chat_with_an_edit_matches_a_fresh_context_with_fewer_tokens(
    tiny_model: Callable[[str], pathlib.Path], streaming: bool
) -> None:
    comparison = compare(lambda name: chat_side(name, tiny_model("gemma3"), streaming))
    chat_with_edit(comparison.ask)
    comparison.check("LlamaCPP")


def test_helpers_find_the_llama_and_pass_the_settings(tiny_model: Callable[[str], pathlib.Path]) -> None:
    llm = LlamaCPP(model_path=str(tiny_model("gemma3")), verbose=False,
                   **ckpt_llamaindex.model_kwargs(n_ctx=768, n_batch=128))
    llama = ckpt_llamaindex.llama_of(llm)
    assert (llama.n_ctx(), llama.n_batch, llama.context_params.swa_full) == (768, 128, False)
    manager = ckpt_llamaindex.attach(llm, load_entrypoints=False)
    assert ckpt_llamaindex.detach(llm) is manager
    with pytest.raises(TypeError, match="LlamaCPP"):
        ckpt_llamaindex.llama_of(object())
