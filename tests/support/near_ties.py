"""Comparing temperature-0 replies of a batched server with a single-sequence server's, up to near ties."""

from __future__ import annotations

from typing import Any

from support.servers import client

BOUND = 90.0
"""Seconds a reference request may take."""

NEAR_TIE = 1e-2
"""A batch of several sequences is computed with matrix kernels whose rounding differs from a single sequence's
(logits differ by about 1e-3): at temperature 0 a reply may differ from the plain server's only where its top two
tokens were this close."""


def reference(plain: Any, messages: list[dict[str, Any]], max_tokens: int = 16) -> tuple[str, list[tuple[str, float]]]:
    """The plain server's reply, and for each of its tokens the margin of the chosen token over the runner-up."""
    chat = client(plain, timeout=BOUND).chat
    reply = chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0, logprobs=True,
                                    top_logprobs=2)
    choice = reply.choices[0]
    margins = []
    for item in choice.logprobs.content if choice.logprobs else []:
        others = [t.logprob for t in item.top_logprobs if t.token != item.token]
        margins.append((item.token, item.logprob - max(others, default=float("-inf"))))
    return choice.message.content or "", margins


def same_or_near_tie(text: str, expected: tuple[str, list[tuple[str, float]]]) -> bool:
    """Whether ``text`` is the expected reply, or leaves it first at a token whose margin was a near tie."""
    expected_text, margins = expected
    if text == expected_text:
        return True
    said = ""
    for token, margin in margins:
        if not text.startswith(said + token):
            return margin < NEAR_TIE
        said += token
    return False
