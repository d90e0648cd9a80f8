"""Checks a request body must pass before a host's route sees it: pure functions, no model, no I/O.

The host (``llama_cpp.server``) turns many bad bodies into a 500, and a few into a dead process: a grammar llama.cpp
cannot compile, a token id outside the vocabulary, a lone surrogate its UTF-8 encoder refuses. Each check here raises
:class:`RequestRejected` with the 4xx status, error code and message the client gets; the route guards
(:mod:`ckpt_plugin.route_guard`) combine them with what only the model knows (vocabulary size, grammar compilation).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

JSON_MEDIA_TYPES = ("application/json",)


class RequestRejected(Exception):
    """A request the server refuses before the host sees it.

    :param status: The HTTP status (4xx).
    :param code: A short machine-readable code (``invalid_json``, ``invalid_request``, ...).
    :param message: What is wrong, for a person.
    """

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def check_content_type(content_type: str | None) -> None:
    """A JSON body must say so; a missing ``Content-Type`` is taken as JSON (what curl users send by mistake).

    :raises RequestRejected: 415 for any other media type.
    """
    if not content_type:
        return
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type in JSON_MEDIA_TYPES or media_type.endswith("+json"):
        return
    raise RequestRejected(415, "unsupported_media_type",
                          f"the request body must be JSON (Content-Type: application/json), got {media_type!r}")


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object whose every string is valid Unicode.

    :raises RequestRejected: 400 for bodies that are not JSON, not an object, nested too deeply, or carry a lone
        surrogate (``"\\ud800"``: valid JSON, but no UTF-8 encoder accepts it).
    """
    if not body.strip():
        raise RequestRejected(400, "invalid_json", "the request body is empty: a JSON object is required")
    try:
        payload = json.loads(body)
    except RecursionError:
        raise RequestRejected(400, "invalid_json", "the request body is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError (non-UTF-8 bytes) alike
        raise RequestRejected(400, "invalid_json", f"the request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise RequestRejected(400, "invalid_json", "the request body must be a JSON object")
    for text in _strings(payload):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestRejected(400, "invalid_unicode",
                                  "the request body holds a lone UTF-16 surrogate (e.g. \\ud800): not valid text")
    return payload


def _strings(value: Any) -> Iterator[str]:
    """Every string in a parsed JSON value, keys included (iteratively: the depth is the parser's to bound)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def check_token_ids(tokens: Any, n_vocab: int, field: str) -> None:
    """Every id in ``tokens`` names a token of the vocabulary (llama.cpp aborts the process on one that does not).

    :raises RequestRejected: 422 naming the first bad id.
    """
    if not isinstance(tokens, list):
        return  # the schema check reports the type
    for index, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < n_vocab:
            raise RequestRejected(422, "invalid_token",
                                  f"{field}[{index}] = {token!r} is not a token id of this model (0..{n_vocab - 1})")


def check_logit_bias(bias: Any, bias_type: Any, n_vocab: int) -> None:
    """``logit_bias`` keys are token ids in the vocabulary (unless ``logit_bias_type`` is ``"tokens"``, whose keys
    are text), and its values finite numbers.

    :raises RequestRejected: 422 naming the bad key or value.
    """
    if not isinstance(bias, Mapping):
        return
    for key, value in bias.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RequestRejected(422, "invalid_request", f"logit_bias[{key!r}] must be a finite number")
        if bias_type == "tokens":
            continue
        token = _int_or_none(key)
        if token is None or not 0 <= token < n_vocab:
            raise RequestRejected(422, "invalid_request",
                                  f"logit_bias key {key!r} is not a token id of this model (0..{n_vocab - 1})")


def check_numbers_given(payload: Mapping[str, Any], fields: tuple[str, ...]) -> None:
    """Fields a schema lets be ``null`` but the sampler needs as numbers (the host passes ``None`` to llama.cpp).

    :raises RequestRejected: 422 naming the field.
    """
    for name in fields:
        if name in payload and payload[name] is None:
            raise RequestRejected(422, "invalid_request", f"{name} must be a number (leave it out for the default)")


def _int_or_none(text: Any) -> int | None:
    if not isinstance(text, str) or not text.strip().lstrip("+-").isdigit() or not text.strip().isascii():
        return None
    return int(text)


@dataclass(frozen=True)
class GrammarSource:
    """A grammar the host will compile for a request.

    :ivar text: GBNF text, or a JSON schema (``is_schema``) the host converts to GBNF first.
    :ivar is_schema: ``text`` is a JSON schema.
    :ivar field: Where it came from, for the error message.
    """

    text: str
    is_schema: bool
    field: str


def completion_grammars(payload: Mapping[str, Any]) -> list[GrammarSource]:
    """The grammars a completion request makes the host compile (``grammar``)."""
    grammar = payload.get("grammar")
    return [GrammarSource(grammar, False, "grammar")] if isinstance(grammar, str) else []


def chat_grammars(payload: Mapping[str, Any]) -> list[GrammarSource]:
    """The grammars a chat request makes the host's chat handler compile: ``grammar``, a ``response_format`` JSON
    schema, and the parameters schema of the tool ``tool_choice`` (or legacy ``function_call``) names.

    :raises RequestRejected: 422 when ``tool_choice`` names a tool the request does not define (the host raises
        inside the model call: a 500).
    """
    sources = completion_grammars(payload)
    response_format = payload.get("response_format")
    if isinstance(response_format, Mapping) and response_format.get("type") == "json_object" \
            and "schema" in response_format:
        sources.append(GrammarSource(json.dumps(response_format["schema"]), True, "response_format.schema"))
    tools = _tools(payload)
    chosen = _chosen_tool(payload)
    if chosen is not None and tools is not None:
        tool = next((t for t in tools if _function_name(t) == chosen), None)
        if tool is None:
            raise RequestRejected(422, "invalid_request", f"tool_choice names {chosen!r}, which is not among tools")
        parameters = tool["function"].get("parameters") if isinstance(tool.get("function"), Mapping) else None
        sources.append(GrammarSource(json.dumps(parameters), True, f"tools[{chosen!r}].parameters"))
    return sources


def _tools(payload: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    functions = payload.get("functions")
    if isinstance(functions, list):  # legacy ``functions`` become tools in the host's handler
        return [{"type": "function", "function": f} for f in functions if isinstance(f, Mapping)]
    tools = payload.get("tools")
    return [t for t in tools if isinstance(t, Mapping)] if isinstance(tools, list) else None


def _chosen_tool(payload: Mapping[str, Any]) -> str | None:
    function_call = payload.get("function_call")
    if isinstance(function_call, Mapping) and isinstance(function_call.get("name"), str):
        return function_call["name"]
    choice = payload.get("tool_choice")
    if isinstance(choice, Mapping) and isinstance(choice.get("function"), Mapping):
        name = choice["function"].get("name")
        return name if isinstance(name, str) else None
    return None


def _function_name(tool: Mapping[str, Any]) -> Any:
    function = tool.get("function")
    return function.get("name") if isinstance(function, Mapping) else None
