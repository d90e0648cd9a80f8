"""Chat formats ckpt-serve registers in llama-cpp-python's registry: a plain transcript for the embedded pretrained
default model (with two example turns before the conversation, or without them), and Gemma 3's own turns for
instruction-tuned Gemma 3 files without a chat template."""

from __future__ import annotations

from typing import Any

from llama_cpp import llama_chat_format as formats
from llama_cpp.llama_chat_format import ChatFormatterResponse, Jinja2ChatFormatter

from ckpt_plugin.hosts.llama_cpp.seam import compat as host

__all__ = [
    "DEFAULT_CHAT_FORMAT",
    "GEMMA3_FORMAT",
    "TRANSCRIPT_FORMAT",
    "TRANSCRIPT_STOP",
    "format_transcript",
    "format_transcript_with_examples",
    "gemma3_formatter",
    "known_chat_formats",
    "register_chat_formats",
]


TRANSCRIPT_FORMAT = "ckpt-transcript"
"""A plain transcript: system messages as a first paragraph, then ``User: ...`` / ``Assistant: ...`` lines, ending
with ``Assistant:``, stopped where the model starts a next turn.

The packaged default model is the *pretrained* Gemma-3-270M (``general.name`` "Gemma 3 270m", no ``-it``), and its
GGUF has no chat template. Gemma's turn format (``<start_of_turn>user ... <end_of_turn>``, :data:`GEMMA3_FORMAT`) is
right for the instruction-tuned checkpoints only: this one never learned the turn tokens, and answers "Hello!" with
``'Hello! mendatanguser\\nHello! mendatanguser...'`` (greedy, 32 tokens). A transcript is a text it continues
(``' Hello!'``, ``' 2+2 = 4'``), but without examples it often repeats the question instead of answering it
(:data:`DEFAULT_CHAT_FORMAT`).
"""

DEFAULT_CHAT_FORMAT = "ckpt-transcript-examples"
"""The chat format ``ckpt-serve`` gives the embedded default model unless ``--chat_format`` (or the config file, or
``CHAT_FORMAT``) names one: :data:`TRANSCRIPT_FORMAT` with :data:`EXAMPLE_TURNS` between the system messages and the
conversation.

A base model continues the kind of text it is given. After a bare ``User: ...`` line, Gemma-3-270M (greedy) answers
one of four plain questions and echoes the others ("Name three fruits." gets ``' Name three fruits.\\nStudent: Name
three fruits.'``); after two example exchanges it answers all four (``' The capital of France is Paris.'``,
``' Apples, oranges, and grapes.'``, docs/server.md, "First run and errors"). The examples are the same tokens at the
start of every conversation, so the prompt cache serves them after the first request. ``--chat_format
ckpt-transcript`` serves the transcript without them.
"""

EXAMPLE_TURNS: tuple[tuple[str, str], ...] = (
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("How many legs does a spider have?", "A spider has eight legs."),
)
"""The (question, answer) exchanges :data:`DEFAULT_CHAT_FORMAT` writes before the conversation: short, factual and
answered in a full sentence, the kind of reply it should give."""

GEMMA3_FORMAT = "gemma3"
"""Gemma 3's own turn format, for instruction-tuned Gemma 3 GGUFs that lack a chat template (``--chat_format gemma3``).

llama-cpp-python's ``gemma`` format writes the same turns but drops a system message (Gemma 3 folds it into the
first user turn) and does not trim contents, so this one renders Google's official template instead.
"""

# The chat template of google/gemma-3-*-it (tokenizer_config.json), as published.
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

TRANSCRIPT_STOP = ["\nUser:", "\nAssistant:"]


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip()
    return " ".join(
        str(part.get("text", "")).strip() for part in content if isinstance(part, dict) and part.get("type") == "text"
    ).strip()


def format_transcript(
    messages: list[dict[str, Any]], examples: tuple[tuple[str, str], ...] = (), **kwargs: Any
) -> Any:
    """:data:`TRANSCRIPT_FORMAT`: system messages as a preamble, then ``User: ...`` / ``Assistant: ...`` lines,
    ending with ``Assistant:``; generation stops where the model starts a next turn.

    :param examples: (question, answer) exchanges written after the system messages, before the conversation
        (:data:`DEFAULT_CHAT_FORMAT`).
    """
    preamble: list[str] = []
    parts: list[str] = [f"User: {question}\nAssistant: {answer}\n" for question, answer in examples]
    for message in messages:
        role, text = message.get("role"), _text(message.get("content"))
        if role in ("system", "developer"):
            # Instructions come first, as a system prompt does: the examples follow them.
            if text:
                preamble.append(f"{text}\n\n")
        elif role == "user":
            parts.append(f"User: {text}\n")
        elif role == "assistant":
            if text:
                parts.append(f"Assistant: {text}\n")
        elif text:  # tool and function results
            parts.append(f"Tool: {text}\n")
    return ChatFormatterResponse(prompt="".join(preamble + parts) + "Assistant:", stop=list(TRANSCRIPT_STOP))


def format_transcript_with_examples(messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    """:data:`DEFAULT_CHAT_FORMAT`: :func:`format_transcript` with :data:`EXAMPLE_TURNS`."""
    return format_transcript(messages, examples=EXAMPLE_TURNS, **kwargs)


def gemma3_formatter() -> Any:
    """:data:`GEMMA3_FORMAT`'s formatter: Google's template, with Gemma's ``<bos>`` and ``<eos>``."""
    return Jinja2ChatFormatter(template=GEMMA3_TEMPLATE, eos_token="<eos>", bos_token="<bos>")


def register_chat_formats() -> None:
    """Register :data:`TRANSCRIPT_FORMAT`, :data:`DEFAULT_CHAT_FORMAT` and :data:`GEMMA3_FORMAT` in llama-cpp-python's
    chat-format registry (once; a ``gemma3`` llama-cpp-python registers itself is kept)."""
    ours = ((TRANSCRIPT_FORMAT, format_transcript), (DEFAULT_CHAT_FORMAT, format_transcript_with_examples),
            (GEMMA3_FORMAT, gemma3_formatter()))
    for name, formatter in ours:
        try:
            formats.get_chat_completion_handler(name)
        except formats.LlamaChatCompletionHandlerNotFoundException:
            formats.LlamaChatCompletionHandlerRegistry().register_chat_completion_handler(
                name, formats.chat_formatter_to_chat_completion_handler(formatter)
            )


def known_chat_formats() -> set[str]:
    """The chat format names ``llama_cpp.server`` accepts: llama-cpp-python's registry (``_chat_handlers``, a
    private attribute) and the handlers its server builds by name
    (:data:`~ckpt_plugin.hosts.llama_cpp.seam.compat.SERVER_CHAT_FORMATS`).
    """
    register_chat_formats()
    return set(formats.LlamaChatCompletionHandlerRegistry()._chat_handlers) | set(host.SERVER_CHAT_FORMATS)
