"""Libraries built on llama-cpp-python, with and without the plugin: LangChain, LlamaIndex and outlines.

Each library runs the same workloads through its own public API on Gemma-3-270M (sliding window 512), side by side
in one process: WITH the plugin (the library's ``Llama`` built with ``swa_full=False`` and attached through
``ckpt_plugin_integrations.<library>``) and WITHOUT it (the library alone, with llama.cpp's default
``swa_full=True``, which is what makes it correct on its own). Tokens evaluated (``manager.stats()`` /
``count_evaluated_tokens``) and wall time of the whole workload (model loading excluded), medians over rounds in
which the two sides alternate; replies are compared.
Tokens evaluated do not depend on the machine's load; wall times do (the machine is shared): the load average at
the start and end of the run is printed with the table.

Workloads:

- chat with an edit: a ~900-token system prompt, two turns, the first question edited (far behind the window),
  back to the first branch for a third turn, that turn regenerated (16 tokens per reply, greedy);
- two conversations: two users of one model (each with its own ~900-token system prompt), three turns each,
  taking turns;
- structured generation (outlines): 6 inputs after the same ~900-token instructions, each answered with a JSON
  object of a pydantic schema (``outlines.Generator``), greedy.

Run: ``.venv/bin/python bench/integrations.py [--quick]``.
"""

from __future__ import annotations

import os
import pathlib
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from _common import Report, cli, emit, fmt_ms, fmt_ratio, gemma_path, ratio
from pydantic import BaseModel

import ckpt_plugin
from ckpt_plugin.hosts.llama_cpp.serving.plain_llama import count_evaluated_tokens

Message = tuple[str, str]
LLAMA_OPTIONS: dict[str, Any] = dict(n_ctx=4096, n_batch=512, n_threads=2, seed=0, verbose=False)
SETTINGS: dict[str, Any] = dict(load_entrypoints=False)
REPLY_TOKENS = 16
WITH, WITHOUT = "with plugin", "without plugin"

_CITIES = ("Lyon", "Porto", "Gdansk", "Leeds", "Turin", "Ghent", "Bilbao", "Malmo", "Graz", "Cork")
_GOODS = ("bicycles", "lamps", "tiles", "books", "coffee", "paper", "chairs", "rope", "glass", "soap")


def _facts(n: int) -> str:
    return " ".join(
        f"Fact {i}: the warehouse in {_CITIES[i % 10]} ships {37 * i % 900 + 12} crates of {_GOODS[i * 7 % 10]} "
        f"every {['Monday', 'Tuesday', 'Wednesday', 'Thursday', 'Friday'][i % 5]}."
        for i in range(1, n + 1)
    )


SYSTEM = "You are a logistics assistant. Answer briefly, using only these facts. " + _facts(44)
SECOND_SYSTEM = "You are a shipping clerk. Reply in one sentence, from these records only. " + _facts(48)[400:]
INSTRUCTIONS = ("Extract the animal described in the text as JSON with its name and its number of legs. "
                "Background you may need: " + _facts(44))
ANIMALS = ("A small grey cat sleeps on the sofa.", "The spider in the garage spun a web overnight.",
           "An old dog barked at the postman.", "A heron stood still in the river.",
           "The ant carried a crumb twice its size.", "A horse grazed in the meadow behind the farm.")


class Animal(BaseModel):
    name: str
    legs: int


def chat_with_edit(ask: Callable[[list[Message]], str]) -> None:
    system = ("system", SYSTEM)
    first = ("user", "Which warehouse ships bicycles, and on which day?")
    reply1 = ask([system, first])
    second = ("user", "And how many crates does the warehouse in Porto ship?")
    reply2 = ask([system, first, ("assistant", reply1), second])
    ask([system, ("user", "Which warehouse ships coffee?")])  # the first question edited
    third = [system, first, ("assistant", reply1), second, ("assistant", reply2),
             ("user", "Which of the two ships more?")]
    ask(third)
    ask(third)  # regenerated


def interleaved_chats(ask: Callable[[list[Message]], str]) -> None:
    """Two users of one model (two system prompts), three turns each, taking turns."""
    histories: list[list[Message]] = [[("system", SYSTEM)], [("system", SECOND_SYSTEM)]]
    questions = ("Which warehouse ships lamps?", "On which day?", "How many crates?")
    for question in questions:
        for history in histories:
            history.append(("user", question))
            history.append(("assistant", ask(list(history))))


# ---------------------------------------------------------------------------------------------------------------------
# the libraries: each builds a model (with or without the plugin) and returns (ask, llama)


def _llama_kwargs(with_plugin: bool) -> dict[str, Any]:
    return {"swa_full": False} if with_plugin else {}


def langchain_chat(path: str, with_plugin: bool) -> tuple[Callable[[list[Message]], str], Any]:
    from langchain_community.chat_models import ChatLlamaCpp
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    from ckpt_plugin_integrations import langchain as ckpt_langchain

    kinds = {"system": SystemMessage, "user": HumanMessage, "assistant": AIMessage}
    kwargs = ckpt_langchain.model_kwargs(n_ctx=LLAMA_OPTIONS["n_ctx"], n_batch=LLAMA_OPTIONS["n_batch"],
                                         n_threads=2)
    if not with_plugin:
        kwargs["model_kwargs"].pop("swa_full")
    llm = ChatLlamaCpp(model_path=path, temperature=0.0, top_k=1, repeat_penalty=1.0, max_tokens=REPLY_TOKENS,
                       seed=0, verbose=False, streaming=False, **kwargs)
    if with_plugin:
        ckpt_langchain.attach(llm, **SETTINGS)
    return (lambda messages: str(llm.invoke([kinds[r](c) for r, c in messages]).content)), llm.client


def llamaindex_chat(path: str, with_plugin: bool) -> tuple[Callable[[list[Message]], str], Any]:
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.llama_cpp import LlamaCPP

    from ckpt_plugin_integrations import llamaindex as ckpt_llamaindex

    kwargs = ckpt_llamaindex.model_kwargs(n_ctx=LLAMA_OPTIONS["n_ctx"], n_batch=LLAMA_OPTIONS["n_batch"],
                                          n_threads=2, seed=0)
    if not with_plugin:
        kwargs["model_kwargs"].pop("swa_full")
    llm = LlamaCPP(model_path=path, temperature=0.0, max_new_tokens=REPLY_TOKENS, verbose=False,
                   generate_kwargs={"top_k": 1, "repeat_penalty": 1.0}, **kwargs)
    if with_plugin:
        ckpt_llamaindex.attach(llm, **SETTINGS)

    def ask(messages: list[Message]) -> str:
        return str(llm.chat([ChatMessage(role=r, content=c) for r, c in messages]).message.content)

    return ask, ckpt_llamaindex.llama_of(llm)


def _outlines_model(path: str, with_plugin: bool, chat_mode: bool) -> tuple[Any, Any]:
    import outlines
    from llama_cpp import Llama

    from ckpt_plugin_integrations import outlines as ckpt_outlines

    llama = Llama(path, **LLAMA_OPTIONS, **_llama_kwargs(with_plugin))
    if with_plugin:
        return ckpt_outlines.from_llamacpp(llama, chat_mode=chat_mode, **SETTINGS), llama
    return outlines.from_llamacpp(llama, chat_mode=chat_mode), llama


GREEDY = dict(temperature=0.0, top_k=1, repeat_penalty=1.0, seed=0)


def outlines_chat(path: str, with_plugin: bool) -> tuple[Callable[[list[Message]], str], Any]:
    from outlines.inputs import Chat

    model, llama = _outlines_model(path, with_plugin, chat_mode=True)
    return (lambda messages: model(Chat([{"role": r, "content": c} for r, c in messages]),
                                   max_tokens=REPLY_TOKENS, **GREEDY)), llama


def outlines_json(path: str, with_plugin: bool) -> tuple[Callable[[list[Message]], str], Any]:
    import outlines

    model, llama = _outlines_model(path, with_plugin, chat_mode=False)
    generator = outlines.Generator(model, Animal)
    return (lambda messages: generator(messages[-1][1], max_tokens=40, **GREEDY)), llama


def structured_job(ask: Callable[[list[Message]], str]) -> None:
    for text in ANIMALS:
        ask([("user", f"{INSTRUCTIONS}\n\nText: {text}\nJSON:")])


@dataclass(frozen=True)
class Workload:
    library: str
    name: str
    build: Callable[[str, bool], tuple[Callable[[list[Message]], str], Any]]
    script: Callable[[Callable[[list[Message]], str]], None]


WORKLOADS = [
    Workload("LangChain `ChatLlamaCpp`", "chat with an edit", langchain_chat, chat_with_edit),
    Workload("LangChain `ChatLlamaCpp`", "two conversations", langchain_chat, interleaved_chats),
    Workload("LlamaIndex `LlamaCPP`", "chat with an edit", llamaindex_chat, chat_with_edit),
    Workload("LlamaIndex `LlamaCPP`", "two conversations", llamaindex_chat, interleaved_chats),
    Workload("outlines", "chat with an edit", outlines_chat, chat_with_edit),
    Workload("outlines", "JSON schema, 6 inputs", outlines_json, structured_job),
]


@dataclass
class Run:
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    replies: list[list[str]] = field(default_factory=list)


def run_once(workload: Workload, path: str, with_plugin: bool, run: Run) -> None:
    ask, llama = workload.build(path, with_plugin)
    manager = ckpt_plugin.manager_of(llama)
    evaluated = count_evaluated_tokens(llama) if manager is None else None
    replies: list[str] = []

    def recorded(messages: list[Message]) -> str:
        reply = ask(messages)
        replies.append(reply)
        return reply

    start = time.perf_counter()
    workload.script(recorded)
    run.seconds.append(time.perf_counter() - start)
    run.tokens.append(int(manager.stats()["tokens_evaluated"]) if manager is not None else evaluated())  # type: ignore[misc]
    run.replies.append(replies)
    if manager is not None:
        ckpt_plugin.detach(llama)
    llama.close()


SECTION = pathlib.Path(__file__).resolve().parents[1] / "docs" / "bench-sections" / "40-libraries.md"


def main() -> None:
    parser = cli(__doc__)
    parser.add_argument("--model", help="another GGUF instead of Gemma-3-270M (e.g. a tiny model, to try the script)")
    args = parser.parse_args()
    rounds = 1 if args.quick else 3
    path = args.model or gemma_path()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    report = Report("Libraries: LangChain, LlamaIndex, outlines (`bench/integrations.py`)")
    report.text(
        f"Gemma-3-270M Q4_K_M, n_ctx {LLAMA_OPTIONS['n_ctx']}, n_batch {LLAMA_OPTIONS['n_batch']}, 2 threads; each "
        "library through its own API, with the plugin (`swa_full=False`, attached through "
        "`ckpt_plugin_integrations.<library>`) and without it (the library alone, llama.cpp's default "
        f"`swa_full=True`); median of {rounds} round(s), the two sides alternating (each first in turn). Chat: a ~900-token system "
        "prompt, two turns, the first question edited, back to the first branch, that turn regenerated "
        f"({REPLY_TOKENS} tokens per reply). Two conversations: two users of one model, each with its own ~900-token "
        "system prompt, three turns each, taking turns. JSON: 6 inputs after the same ~900-token instructions, "
        "`outlines.Generator` with a pydantic schema. Command: `.venv/bin/python bench/integrations.py`."
    )
    load_before = os.getloadavg()[0]
    rows = []
    for workload in WORKLOADS:
        runs = {WITH: Run(), WITHOUT: Run()}
        for round_index in range(rounds):
            order = [WITH, WITHOUT] if round_index % 2 == 0 else [WITHOUT, WITH]  # neither side always first
            for side in order:
                run_once(workload, path, side == WITH, runs[side])
        with_, without = runs[WITH], runs[WITHOUT]
        tokens_with, tokens_without = statistics.median(with_.tokens), statistics.median(without.tokens)
        time_with, time_without = statistics.median(with_.seconds), statistics.median(without.seconds)
        same = "yes" if with_.replies[0] == without.replies[0] else "no"
        rows.append([workload.library, workload.name, f"{tokens_with:,.0f}", f"{tokens_without:,.0f}",
                     fmt_ratio(ratio(tokens_without, tokens_with)), fmt_ms(time_with), fmt_ms(time_without),
                     fmt_ratio(ratio(time_without, time_with)), same])
        print(" | ".join(rows[-1]), flush=True)
        report.figure(f"{workload.library}, {workload.name}: tokens evaluated without / with the plugin",
                      fmt_ratio(ratio(tokens_without, tokens_with)))
    report.text(f"Load average (1 min) at the start: {load_before:.1f}, at the end: {os.getloadavg()[0]:.1f}.")
    report.text("'same replies': the first round's replies of the two sides are identical. The sides fill their caches "
                "in different batches (reuse, `swa_full`), which moves Q4_K logits by rounding, so where the model is "
                "within rounding of a tie they may pick different tokens (docs/correctness.md); the tests compare "
                "answers with that allowance (tests/integrations/test_integration_*.py).")
    report.table(["library", "workload", "tokens evaluated with", "without", "ratio", "time with", "without",
                  "speed-up", "same replies"], rows)
    emit(report, args.json)
    if not args.model and not args.quick:
        # The docs section, included by every regeneration of docs/benchmarks.md (bench/run_all.py).
        SECTION.write_text(report.markdown())


if __name__ == "__main__":
    main()
