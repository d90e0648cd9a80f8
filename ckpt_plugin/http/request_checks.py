"""Checks a request body must pass before a host's route sees it: pure functions, no model, no I/O.

The host (``llama_cpp.server``) turns many bad bodies into a 500, and a few into a dead process: a grammar llama.cpp
cannot compile, a token id outside the vocabulary, a lone surrogate its UTF-8 encoder refuses. Each check here raises
:class:`RequestRejected` with the 4xx status, error code and message the client gets; the route guards
(:mod:`ckpt_plugin.http.route_guard`) combine them with what only the model knows (vocabulary size, grammar compilation).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

__all__ = [
    "GrammarSource",
    "RequestRejected",
    "chat_grammars",
    "check_content_type",
    "check_generation_flags",
    "check_logit_bias",
    "check_no_control_characters",
    "check_numbers_given",
    "check_prompt_fits",
    "check_reply_fits",
    "check_token_ids",
    "completion_grammars",
    "parse_json_object",
    "prompt_text_bytes",
]

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


PROMPT_BYTES_PER_TOKEN_FACTOR = 2
"""How many times the longest token's text a token may cover on average before a prompt is refused unread: a margin
for tokenizers that normalize the text (a token's text is otherwise at least as long as what it covers)."""


def prompt_text_bytes(payload: Mapping[str, Any]) -> int:
    """UTF-8 bytes of the text a request's prompt is made of: a completion's ``prompt`` string (or one-string list),
    a chat's message contents (strings and text parts, before the chat template adds its own)."""
    texts: list[str] = []
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        texts.append(prompt)
    elif isinstance(prompt, list):
        texts.extend(item for item in prompt if isinstance(item, str))
    messages = payload.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(part["text"] for part in content
                         if isinstance(part, Mapping) and isinstance(part.get("text"), str))
    return sum(len(text.encode("utf-8", "surrogatepass")) for text in texts)


def check_prompt_fits(n_bytes: int, n_ctx: int, longest_token_bytes: int) -> None:
    """Refuse a prompt of ``n_bytes`` bytes of text that cannot fit ``n_ctx`` tokens, before it is tokenized: no token
    stands for more than ``longest_token_bytes`` bytes (the host tokenized a 20 MB prompt for 32 s, holding a place
    in the queue, before refusing it).

    :raises RequestRejected: 400 ``context_length_exceeded`` past ``n_ctx * longest_token_bytes *``
        :data:`PROMPT_BYTES_PER_TOKEN_FACTOR` bytes.
    """
    limit = n_ctx * longest_token_bytes * PROMPT_BYTES_PER_TOKEN_FACTOR
    if n_bytes > limit:
        raise RequestRejected(400, "context_length_exceeded",
                              f"the prompt is {n_bytes} bytes of text, far more than this model's context of {n_ctx} "
                              f"tokens can hold (no token stands for more than {longest_token_bytes} bytes; prompts "
                              f"over {limit} bytes are refused before they are tokenized)")


@dataclass(frozen=True)
class GrammarSource:
    """A grammar the host will compile for a request.

    :ivar text: GBNF text, or a JSON schema (``is_schema``) the host converts to GBNF first.
    :ivar is_schema: ``text`` is a JSON schema.
    :ivar field: Where it came from, for the error message.
    :ivar least_size: For a schema, the fewest characters a reply that matches it holds, as its size bounds
        (``minLength``, ``minItems``, ...) multiply down the schema (:func:`least_reply_size`); 0 for GBNF.
    """

    text: str
    is_schema: bool
    field: str
    least_size: int = 0


SIZE_BOUNDS = ("minLength", "minItems", "minProperties", "minContains")
"""JSON schema keywords that set how large a value must be (characters, array items, object members)."""


def least_reply_size(schema: Any) -> int:
    """The fewest characters a JSON value matching ``schema`` holds, as far as its size bounds tell: the largest
    product of ``minLength``, ``minItems``, ``minProperties`` and ``minContains`` down any path of nested schemas
    (an array of 1,000 strings of 1,000 characters holds a million). Computed without converting the schema: the
    conversion itself writes a minimum length out character by character (``minLength`` 10^8 is a 500 MB grammar).
    """
    largest = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, factor = stack.pop()
        if isinstance(node, Mapping):
            bounds = [int(value) for key in SIZE_BOUNDS
                      if isinstance(value := node.get(key), (int, float)) and not isinstance(value, bool)
                      and math.isfinite(value) and value > 1]
            factor *= max(bounds, default=1)
            largest = max(largest, factor)
            stack.extend((child, factor) for child in node.values() if isinstance(child, (Mapping, list)))
        elif isinstance(node, list):
            stack.extend((child, factor) for child in node if isinstance(child, (Mapping, list)))
    return largest if largest > 1 else 0


def check_reply_fits(source: GrammarSource, n_ctx: int, longest_token_bytes: int) -> None:
    """Refuse at once a schema whose size bounds ask for a reply that ``n_ctx`` tokens cannot hold (no token stands
    for more than ``longest_token_bytes`` bytes, and a character is a byte at least), without compiling it.

    :raises RequestRejected: 422 ``invalid_grammar`` naming the field.
    """
    limit = n_ctx * longest_token_bytes
    if source.least_size > limit:
        raise RequestRejected(422, "invalid_grammar",
                              f"{source.field}: its size bounds (minLength, minItems, ...) ask for a reply of at least "
                              f"{source.least_size} characters, more than this model's context of {n_ctx} tokens can "
                              f"hold (no token stands for more than {longest_token_bytes} bytes)")


_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")
"""Control characters other than tab, line feed and carriage return."""


def check_no_control_characters(value: Any, field: str) -> None:
    """No string in ``value`` (keys included) holds a control character other than tab, line feed and carriage
    return.

    A grammar reaches llama.cpp as a C string, which a NUL ends: the host compiles what comes before it. Through a
    JSON schema, a NUL or another control character in a property name, an ``enum`` or ``const`` value becomes a
    character the grammar requires that no token holds, and llama.cpp's sampler aborts the process when it gets
    there.

    :raises RequestRejected: 422 ``invalid_grammar`` naming the field and the character.
    """
    for text in _strings(value):
        found = _CONTROL.search(text)
        if found is not None:
            raise RequestRejected(422, "invalid_grammar",
                                  f"{field}: holds the control character U+{ord(found.group()):04X}, which a grammar "
                                  "cannot carry to llama.cpp (only tab, line feed and carriage return are allowed)")


def completion_grammars(payload: Mapping[str, Any]) -> list[GrammarSource]:
    """The grammars a completion request makes the host compile (``grammar``).

    :raises RequestRejected: 422 for control characters in it (:func:`check_no_control_characters`).
    """
    grammar = payload.get("grammar")
    if not isinstance(grammar, str):
        return []
    check_no_control_characters(grammar, "grammar")
    return [GrammarSource(grammar, False, "grammar")]


def chat_grammars(payload: Mapping[str, Any]) -> list[GrammarSource]:
    """The grammars a chat request makes the host's chat handler compile: ``grammar``, a ``response_format`` JSON
    schema, and the parameters schema of the tool ``tool_choice`` (or legacy ``function_call``) names.

    :raises RequestRejected: 422 when ``tool_choice`` names a tool the request does not define (the host raises
        inside the model call: a 500), or for control characters in any of these or in any tool's parameters
        (:func:`check_no_control_characters`: chat formats with function calling compile every tool's).
    """
    sources = completion_grammars(payload)
    response_format = payload.get("response_format")
    if isinstance(response_format, Mapping) and response_format.get("type") == "json_object" \
            and "schema" in response_format:
        schema = response_format["schema"]
        check_no_control_characters(schema, "response_format.schema")
        sources.append(GrammarSource(json.dumps(schema), True, "response_format.schema", least_reply_size(schema)))
    tools = _tools(payload)
    for index, tool in enumerate(tools or ()):
        function = tool.get("function")
        if isinstance(function, Mapping):
            check_no_control_characters(function.get("parameters"), f"tools[{index}].function.parameters")
    chosen = _chosen_tool(payload)
    if chosen is not None and tools is not None:
        tool = next((t for t in tools if _function_name(t) == chosen), None)
        if tool is None:
            raise RequestRejected(422, "invalid_request", f"tool_choice names {chosen!r}, which is not among tools")
        parameters = tool["function"].get("parameters") if isinstance(tool.get("function"), Mapping) else None
        sources.append(GrammarSource(json.dumps(parameters), True, f"tools[{chosen!r}].parameters",
                                     least_reply_size(parameters)))
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


def check_generation_flags(payload: Mapping[str, Any]) -> None:
    """Fields the middleware itself honours on generation routes are of their type (``ignore_eos``: a boolean).

    :raises RequestRejected: 422 naming the field.
    """
    value = payload.get("ignore_eos")
    if value is not None and not isinstance(value, bool):
        raise RequestRejected(422, "invalid_request", f"ignore_eos must be true or false, got {value!r}")
