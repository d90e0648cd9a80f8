"""Running one workload through a library three ways and comparing: with the plugin, the library alone, and the
library alone on a fresh context for every request.

- ``plugin``: the library object attached through its helper (``swa_full=False``: only the window in memory);
- ``plain``: the same library object unattached with llama-cpp-python's defaults (``swa_full=True``: the whole
  context in memory, which is what makes the library alone correct), reusing prefixes as the library does;
- ``fresh``: like ``plain``, its memory emptied before every request: the reference answers.

Each request goes to every side with the same messages (a conversation continues with the plugin side's replies),
and the tokens every ``Llama.generate`` call produced are recorded with the top-2 logit gap of each step, so answers
are compared with the project's near-tie rule (``ckpt_plugin.testing.assert_same_answer``, docs/correctness.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

import ckpt_plugin
from ckpt_plugin.hosts.llama_cpp.serving.plain_llama import count_evaluated_tokens
from ckpt_plugin.hosts.llama_cpp.seam.context import clear_memory, last_logits
from ckpt_plugin.testing import assert_same_answer

Message = tuple[str, str]
"""``(role, content)`` of a chat message."""

WORDS = ("the", "a", "and", "of", "to", "in", "is", "it", "that", "this", "hello", "world", "you", "for", "on",
         "cat", "dog", "one", "two")
"""Words the tiny test models' vocabulary holds whole."""


def words(n: int, seed: int) -> str:
    """``n`` pseudo-random words of the tiny vocabulary (about one token each)."""
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n))


@dataclass
class Generation:
    """One ``Llama.generate`` call: the prompt, the tokens it yielded, and the top-2 logit gap before each."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)


class GenerationLog:
    """Records every ``generate`` call of one ``Llama`` (installed over whatever ``generate`` it has now: install it
    after ``attach``, which patches ``generate`` itself)."""

    def __init__(self, llama: Any) -> None:
        self.calls: list[Generation] = []
        inner = llama.generate

        def recording_generate(tokens: Sequence[int], *args: Any, **kwargs: Any) -> Iterator[int]:
            call = Generation(list(tokens))
            self.calls.append(call)
            for token in inner(tokens, *args, **kwargs):
                top2 = np.partition(last_logits(llama), -2)[-2:]
                call.gaps.append(float(abs(top2[1] - top2[0])))
                call.tokens.append(int(token))
                yield token

        llama.generate = recording_generate


@dataclass
class Side:
    """One way of running the workload: ``ask(messages) -> reply`` through the library, over ``llama``."""

    name: str
    ask: Callable[[list[Message]], str]
    llama: Any
    log: GenerationLog = field(init=False)
    replies: list[str] = field(default_factory=list)

    @property
    def fresh(self) -> bool:
        return self.name == "fresh"

    def __post_init__(self) -> None:
        assert self.name in ("plugin", "plain", "fresh")
        self.log = GenerationLog(self.llama)
        if not self.fresh and ckpt_plugin.manager_of(self.llama) is None:
            self._evaluated = count_evaluated_tokens(self.llama)

    def send(self, messages: list[Message]) -> str:
        if self.fresh:
            self.llama.reset()
            clear_memory(self.llama)
        reply = self.ask(messages)
        self.replies.append(reply)
        return reply

    @property
    def tokens_evaluated(self) -> int:
        manager = ckpt_plugin.manager_of(self.llama)
        return int(manager.stats()["tokens_evaluated"]) if manager is not None else self._evaluated()


class Comparison:
    """Sends each request to the plugin, plain and fresh sides; :meth:`check` compares what they did."""

    def __init__(self, plugin: Side, plain: Side, fresh: Side) -> None:
        assert fresh.fresh and ckpt_plugin.manager_of(plugin.llama) is not None
        self.plugin, self.plain, self.fresh = plugin, plain, fresh

    def ask(self, messages: list[Message]) -> str:
        """The plugin side's reply to ``messages``, after every side answered them."""
        reply = self.plugin.send(messages)
        self.plain.send(messages)
        self.fresh.send(messages)
        return reply

    def check(self, what: str) -> None:
        """Same prompts and answers on every side (near-ties aside); fewer tokens evaluated with the plugin."""
        want = self.fresh.log.calls
        for side in (self.plugin, self.plain):
            got = side.log.calls
            assert len(got) == len(want), f"{what}: {side.name} made {len(got)} generate calls, fresh {len(want)}"
            for index, (call, reference) in enumerate(zip(got, want)):
                assert call.prompt == reference.prompt, f"{what}: {side.name} request {index} has another prompt"
                assert_same_answer(call.tokens, reference.tokens, reference.gaps,
                                   f"{what}: {side.name} request {index}")
        exact = [i for i, (a, b) in enumerate(zip(self.plugin.log.calls, want)) if a.tokens == b.tokens]
        for index in exact:
            assert self.plugin.replies[index] == self.fresh.replies[index], f"{what}: reply {index} differs"
        assert self.plugin.tokens_evaluated < self.plain.tokens_evaluated, (
            f"{what}: the plugin evaluated {self.plugin.tokens_evaluated} tokens, "
            f"the library alone {self.plain.tokens_evaluated}"
        )


def compare(make_side: Callable[[str], Side]) -> Comparison:
    """The three sides ``make_side("plugin")``, ``make_side("plain")`` and ``make_side("fresh")``."""
    return Comparison(*(make_side(name) for name in ("plugin", "plain", "fresh")))


SYSTEM = "you answer in words: " + words(150, seed=1)
"""A system prompt of about 160 tokens: far longer than the tiny gemma3 model's 32-token window."""


def chat_with_edit(ask: Callable[[list[Message]], str]) -> None:
    """A conversation of two turns, an edit of the first question (deep: the window has long moved past it), a
    return to the first branch for a third turn, and a regeneration of that turn."""
    system = ("system", SYSTEM)
    first = ("user", words(40, seed=2))
    reply1 = ask([system, first])
    second = ("user", words(30, seed=3))
    reply2 = ask([system, first, ("assistant", reply1), second])
    ask([system, ("user", words(25, seed=4))])  # the first question edited
    third = [system, first, ("assistant", reply1), second, ("assistant", reply2), ("user", words(20, seed=5))]
    ask(third)
    ask(third)
