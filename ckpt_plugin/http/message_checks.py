"""Checks of a chat request's ``messages`` that the host's schema lets through, though the host cannot serve them.

- An empty (or missing) ``messages`` list: the host's schema defaults it to ``[]`` and the chat template renders a
  prompt of its own markup only, which the model continues; the OpenAI API refuses such a request with a 400, and so
  does the middleware.
- Images, audio and files in a server that cannot read them: a chat handler without a multimodal projector keeps the
  text parts of a message and drops the others (or renders a ``data:`` URI as text), so the reply is about a
  message the client did not send. The OpenAI API's media parts (``image_url``, ``input_audio``, ``file``) are
  refused with a 400 that says how to serve images; with a projector, parts other than ``image_url`` (which
  llama-cpp-python's multimodal handlers do not read) are refused too.

Pure functions over the parsed body, like :mod:`ckpt_plugin.http.request_checks`.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

from ckpt_plugin.http.request_checks import RequestRejected

__all__ = ["check_media_readable", "check_messages_given"]

MEDIA_PARTS: dict[str, str] = {"image_url": "an image", "input_audio": "audio", "file": "a file"}
"""The OpenAI API's content part types that carry something other than text, and what each carries (for the
message)."""


def check_messages_given(payload: Mapping[str, Any]) -> None:
    """A chat request names at least one message.

    :raises RequestRejected: 400 ``invalid_request`` for a missing or empty ``messages`` (another type is the
        schema's to refuse).
    """
    messages = payload.get("messages")
    if messages is None or messages == []:
        raise RequestRejected(400, "invalid_request",
                              "messages must hold at least one message (got "
                              f"{'none' if messages is None else 'an empty list'})")


def media_parts(payload: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """``(where, type)`` of every media part of the request's messages, ``where`` as ``messages[i].content[j]``
    (tolerant of any shape: the schema reports what is malformed)."""
    messages = payload.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, Mapping) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if isinstance(kind, str) and kind in MEDIA_PARTS:
                yield f"messages[{i}].content[{j}]", kind


def check_media_readable(payload: Mapping[str, Any], multimodal: bool, how: str) -> None:
    """Refuse media parts that the model's chat handler would drop.

    :param multimodal: The model's chat handler reads images (a projector is loaded): ``image_url`` parts pass.
        Its other media parts are refused all the same: llama-cpp-python's multimodal handlers read ``image_url``
        parts only.
    :param how: What the server reads and what enables images (its flags), for the message.
    :raises RequestRejected: 400 ``multimodal_disabled`` naming the first such part.
    """
    for where, kind in media_parts(payload):
        if multimodal and kind == "image_url":
            continue
        what = f"{where} is {MEDIA_PARTS[kind]} (type {kind}), which this model cannot read: it would be dropped " \
               "from the prompt."
        if multimodal:
            raise RequestRejected(400, "multimodal_disabled",
                                  f"{what} Its multimodal chat handler reads text and image_url parts only.")
        raise RequestRejected(400, "multimodal_disabled", f"{what} {how}")
