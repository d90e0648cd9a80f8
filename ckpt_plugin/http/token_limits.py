"""``max_completion_tokens``, the OpenAI API's current name of a reply's token limit, on both completion routes.

llama-cpp-python's request schemas know only ``max_tokens`` (the API's older name, deprecated there) and ignore any
field they do not know: a client that sends ``max_completion_tokens: 5`` got a reply as long as the context allows
(chat) or 16 tokens (completions). The middleware hands the host ``max_tokens`` instead, so the host stops the reply
itself: ``finish_reason`` is ``"length"`` and ``usage.completion_tokens`` counts what it produced, streamed or not.

Both names given with different values are refused (400): which one a client meant cannot be told, and a limit
silently ignored is what this module is here to end. The same value under both names passes.
"""

from __future__ import annotations

import json
from typing import Any

from ckpt_plugin.http.request_checks import RequestRejected

__all__ = ["with_max_completion_tokens"]

CURRENT = "max_completion_tokens"
OLDER = "max_tokens"


def with_max_completion_tokens(payload: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
    """The request as the host reads it: ``max_completion_tokens`` given as ``max_tokens`` (``null``: as if absent).

    :return: ``payload`` and ``body`` unchanged when it names no ``max_completion_tokens``; else the rewritten
        payload and its JSON.
    :raises RequestRejected: 422 ``invalid_request`` for a value that is not a whole number of at least 1 (the
        host would read 0 as "up to the context"); 400 ``invalid_request`` when ``max_tokens`` names another.
    """
    if CURRENT not in payload:
        return payload, body
    limit = payload[CURRENT]
    rewritten = {key: value for key, value in payload.items() if key != CURRENT}
    if limit is None:
        return rewritten, json.dumps(rewritten).encode()
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise RequestRejected(422, "invalid_request", f"{CURRENT} must be a whole number of at least 1, got {limit!r}")
    older = payload.get(OLDER)
    if older is not None and older != limit:
        raise RequestRejected(400, "invalid_request",
                              f"{OLDER} ({older!r}) and {CURRENT} ({limit!r}) differ: send one of them "
                              f"({CURRENT} is the OpenAI API's current name, {OLDER} its older one)")
    rewritten[OLDER] = limit
    return rewritten, json.dumps(rewritten).encode()
