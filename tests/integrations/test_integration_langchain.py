"""LangChain (``langchain-community``'s ``ChatLlamaCpp`` and ``LlamaCpp``) with and without the plugin, through
LangChain's own API, on the tiny gemma3 model (32-token sliding window): same answers as a fresh context, fewer
tokens evaluated than LangChain alone."""

from __future__ import annotations

import pathlib
from typing import Any, Callable

import pytest

pytest.importorskip("langchain_community", reason="LangChain is not installed (pip install 'ckpt_plugin[langchain]')")

from langchain_community.chat_models import ChatLlamaCpp  # noqa: E402
from langchain_community.llms import LlamaCpp  # noqa: E402
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage  # noqa: E402

from ckpt_plugin_integrations import langchain as ckpt_langchain  # noqa: E402

from support.library_runs import SYSTEM, Message, Side, chat_with_edit, compare, words  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
SETTINGS = dict(checkpoint_min_step=16, load_entrypoints=False)
GREEDY = dict(temperature=0.0, top_k=1, repeat_penalty=1.0, max_tokens=8, seed=0, verbose=False, n_threads=2)
LANGCHAIN_MESSAGES: dict[str, Callable[[str], BaseMessage]] = {
    "system": SystemMessage, "user": HumanMessage, "assistant": AIMessage,
}


def _model_kwargs(side: str) -> dict[str, Any]:
    kwargs = ckpt_langchain.model_kwargs(n_ctx=1024, n_batch=64)
    if side != "plugin":
        kwargs["model_kwargs"].pop("swa_full")  # the library alone is correct only with llama.cpp's default
    return kwargs


def _attached(llm: Any, side: str) -> Any:
    if side == "plugin":
        ckpt_langchain.attach(llm, **SETTINGS)
    return ckpt_langchain.llama_of(llm)


@pytest.mark.parametrize("streaming", [False, True], ids=["invoke", "stream"])
def test_chat_with_an_edit_matches_a_fresh_context_with_fewer_tokens(
    tiny_model: Callable[[str], pathlib.Path], streaming: bool
) -> None:
    def chat_side(name: str) -> Side:
        llm = ChatLlamaCpp(model_path=str(tiny_model("gemma3")), streaming=streaming, **GREEDY, **_model_kwargs(name))

        def ask(messages: list[Message]) -> str:
            return str(llm.invoke([LANGCHAIN_MESSAGES[role](content) for role, content in messages]).content)

        return Side(name, ask, _attached(llm, name))

    comparison = compare(chat_side)
    chat_with_edit(comparison.ask)
    comparison.check("ChatLlamaCpp")


def test_completions_sharing_a_prefix(tiny_model: Callable[[str], pathlib.Path]) -> None:
    def completion_side(name: str) -> Side:
        llm = LlamaCpp(model_path=str(tiny_model("gemma3")), **GREEDY, **_model_kwargs(name))
        return Side(name, lambda messages: llm.invoke(messages[-1][1]), _attached(llm, name))

    comparison = compare(completion_side)
    for seed in (10, 11, 10, 12):  # the third returns to the first document
        comparison.ask([("user", f"{SYSTEM}\ndocument: {words(30, seed)}\nsummary:")])
    comparison.check("LlamaCpp")


def test_helpers_find_the_llama_and_refuse_other_objects(tiny_model: Callable[[str], pathlib.Path]) -> None:
    llm = ChatLlamaCpp(model_path=str(tiny_model("llama")), **GREEDY, **ckpt_langchain.model_kwargs(n_ctx=512))
    llama = ckpt_langchain.llama_of(llm)
    assert llama.n_ctx() == 512 and llama.n_batch == 512
    manager = ckpt_langchain.attach(llm, load_entrypoints=False)
    assert ckpt_langchain.attach(llm) is manager  # attached already (as under ckpt-run): the same manager
    assert ckpt_langchain.detach(llm) is manager
    with pytest.raises(TypeError, match="ChatLlamaCpp or LlamaCpp"):
        ckpt_langchain.llama_of(object())
