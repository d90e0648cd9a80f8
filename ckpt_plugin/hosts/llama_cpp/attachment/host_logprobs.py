"""The host's completion as the attachment runs it: the logits a request reads noted for its evaluation, and a
logprobs request served by the host without logprobs, with the logprobs it would have computed filled in
(:class:`~ckpt_plugin.hosts.llama_cpp.attachment.logprobs.CompletionTrace` computes them, vectorized)."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterator, Sequence

import llama_cpp
from llama_cpp.llama import Llama

from ckpt_plugin.hosts.llama_cpp.attachment.logprobs import CompletionTrace, LogprobsRequest, stop_sequences
from ckpt_plugin.hosts.llama_cpp.seam import compat as host

__all__ = ["completion_noting_reads", "completion_with_host_logprobs", "completion_with_reads"]


def completion_noting_reads(llama: Llama, create_completion: Callable[..., Iterator[Any]],
                            signature: inspect.Signature, args: tuple, kwargs: dict,
                            note_reads: Callable[[tuple[bool, bool]], None]) -> Iterator[Any]:
    """The host's completion ``create_completion(*args, **kwargs)`` (its ``_create_completion``, bound; ``signature``
    its class's), with ``note_reads((logprobs, echo))`` called when the host's body starts, so that evaluation
    computes and keeps only the logits the request reads. A request for logprobs runs the host without them and gets
    them from :func:`completion_with_host_logprobs` (the same values, vectorized)."""
    bound = signature.bind(llama, *args, **kwargs)
    logprobs = bound.arguments.get("logprobs")
    reads = (logprobs is not None, bool(bound.arguments.get("echo", False)))
    if logprobs is None or not host.wants_all_logits(llama):
        # Without logits_all the host refuses logprobs itself, after its other checks: left to it.
        return completion_with_reads(llama, create_completion(*args, **kwargs), reads, note_reads)
    defaults = signature.parameters

    def argument(name: str) -> Any:
        return bound.arguments.get(name, defaults[name].default)

    request = LogprobsRequest(prompt=argument("prompt"), logprobs=logprobs, echo=bool(argument("echo")),
                              stream=bool(argument("stream")), stop=stop_sequences(argument("stop")))
    bound.arguments["logprobs"] = None
    return completion_with_reads(llama, create_completion(*bound.args[1:], **bound.kwargs), reads, note_reads, request)


def completion_with_reads(llama: Llama, completion: Iterator[Any], reads: tuple[bool, bool],
                          note_reads: Callable[[tuple[bool, bool]], None],
                          logprobs: LogprobsRequest | None = None) -> Iterator[Any]:
    """Iterate the host's ``completion`` for a request reading ``reads``; with ``logprobs``, the host runs without
    them and they are filled in (:func:`completion_with_host_logprobs`)."""
    # Noted on the first next(), the call in which the host's body calls generate().
    note_reads(reads)
    if logprobs is None:
        yield from completion
    else:
        yield from completion_with_host_logprobs(llama, completion, logprobs)


def completion_with_host_logprobs(llama: Llama, completion: Iterator[Any], request: LogprobsRequest) -> Iterator[Any]:
    """The host's response to a logprobs request, with the logprobs it would have computed.

    The host's ``completion`` runs with ``logprobs=None``. Its ``generate`` call is watched (a wrapper installed
    on the instance for its first ``next()`` only, the call in which the host calls ``generate``) by a
    :class:`~ckpt_plugin.hosts.llama_cpp.attachment.logprobs.CompletionTrace`, which learns the prompt and completion
    tokens. Non-streamed: the single response gets ``logprobs`` computed from the rows after the generation, where the
    host computes them. Streamed: without logprobs the host groups tokens into chunks differently, so its chunks
    are dropped and the trace's replay of the logprobs loop (one chunk per token, computed as each token arrived)
    is yielded in their place, then its tail, then the host's final chunk.
    """
    vocab = llama_cpp.llama_model_get_vocab(llama.model)
    trace = CompletionTrace(
        detokenize=llama.detokenize,
        log_softmax=Llama.logits_to_logprobs,
        scores=lambda: llama.scores[: llama.n_tokens, :],
        is_eog=lambda token: bool(llama_cpp.llama_vocab_is_eog(vocab, token)),
        bos_token_id=llama.token_bos(),
        request=request,
    )
    end = object()
    template: dict[str, Any] | None = None
    try:
        generate = llama.generate

        def watched_generate(tokens: Sequence[int], *args: Any, **kwargs: Any) -> Iterator[int]:
            # No reference to the watcher is kept here: the host's loop owns it, and dropping it (a break)
            # closes the generation at once, as without the watcher.
            return trace.watch(tokens, generate(tokens, *args, **kwargs))

        llama.generate = watched_generate
        try:
            chunk = next(completion, end)
        finally:
            if llama.__dict__.get("generate") is watched_generate:
                llama.generate = generate
        if not request.stream:
            if chunk is not end:
                chunk["choices"][0]["logprobs"] = trace.logprobs(llama.scores[: llama.n_tokens, :])
                yield chunk
            yield from completion
            return
        while chunk is not end:
            template = chunk
            if trace.error is not None:
                yield from trace.take(chunk)
                raise trace.error
            if chunk["choices"][0]["finish_reason"] is None:
                yield from trace.take(chunk)  # the host's own chunk stands for tokens the trace yields itself
            else:
                trace.tail()
                yield from trace.take(chunk)
                yield chunk
            chunk = next(completion, end)
    except Exception:
        # What the host had yielded before failing (it yields as it goes) still reaches the client.
        if template is not None and trace.pending:
            yield from trace.take(template)
        raise
    finally:
        close = getattr(completion, "close", None)
        if close is not None:
            close()
