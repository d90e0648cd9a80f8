"""One multimodal request as the engine serves it (:class:`MediaFlow`): the prompt a multimodal chat handler tokenized,
in token ids (media positions as their content's ids), and its text and media chunks served, as the handler evaluates
them, from the longest prefix the memory, a checkpoint or the cache holds.

The relay that arms a flow and hands it the handler's media chunks is
:mod:`ckpt_plugin.hosts.llama_cpp.attachment.multimodal`.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ckpt_plugin.core.media import media_start
from ckpt_plugin.core.request import current_request
from ckpt_plugin.hosts.llama_cpp.attachment.outside_writes import Watched, engine_writes

__all__ = ["MediaFlow"]


class MediaFlow:
    """One multimodal request of the handler, as the engine serves it: its prompt in token ids (media positions
    negative), how far the handler has got, and where the memory stood when the request was prepared.

    The attachment calls :meth:`eval_text` from its ``eval`` and the relay :meth:`eval_media`, both under the
    slot's lock; ``prepare`` is the engine's (keeps the longest stored prefix of a prompt and returns its length),
    ``process`` evaluates tokens after the memory's end, ``process_media`` records a media chunk decoded by
    ``decode``, ``sync_host`` writes the host's ``input_ids`` / ``n_tokens``.
    """

    def __init__(self, watched: Watched | None, llama: Any, prepare: Callable[[np.ndarray, int | None], int],
                 memory_end: Callable[[], int], process: Callable[[np.ndarray, int], None],
                 process_media: Callable[[np.ndarray, Callable[[], None], int], None]) -> None:
        self._watched = watched
        self._llama = llama
        self._prepare = prepare
        self._memory_end = memory_end
        self._process = process
        self._process_media = process_media
        self.tokens: np.ndarray | None = None
        self.spans: list[tuple[int, int]] = []
        self.cursor = 0
        self.kept: int | None = None
        # Whether the request drafts with a draft model (parallel slots say so for their own drafts).
        self.drafting: Callable[[], bool] = lambda: getattr(llama, "draft_model", None) is not None
        # Set where nothing can be left to the host (parallel slots: the handler would decode into sequence 0, another
        # request's): a prompt whose media cannot be keyed is refused instead.
        self.must_key = False

    @property
    def serves_media(self) -> bool:
        """Whether media chunks can be served as keyed positions: not with a draft model, which would be handed the
        media positions' ids as tokens."""
        return not self.drafting()

    @property
    def armed(self) -> bool:
        return self.tokens is not None

    def arm(self, tokens: np.ndarray, spans: list[tuple[int, int]]) -> None:
        """The handler is about to evaluate ``tokens``, whose media chunks are at ``spans`` (after its reset and
        memory clear, which are skipped)."""
        self.tokens, self.spans, self.cursor, self.kept = tokens, spans, 0, None
        if self._watched is not None:
            self._watched.skip_clears()

    def disarm(self) -> None:
        self.tokens, self.spans, self.cursor, self.kept = None, [], 0, None
        if self._watched is not None:
            self._watched.cancel_skip()

    def completed(self, prompt: np.ndarray) -> bool:
        """Whether ``prompt`` is this request's prompt, every chunk of it handed to the engine."""
        tokens = self.tokens
        return tokens is not None and self.cursor == len(tokens) and np.array_equal(prompt, tokens)

    def _prepared(self) -> None:
        tokens = self.tokens
        assert tokens is not None
        if self.kept is not None:
            return
        if self._watched is not None:
            self._watched.cancel_skip()  # the handler's clears are behind: any later one is real
        # The last token is left to the completion that follows (fresh logits, as for any prompt).
        n_keep = self._prepare(tokens, len(tokens) - 1)
        start = media_start(self.spans, n_keep)
        if start != n_keep:
            n_keep = self._prepare(tokens, start)
        self.kept = n_keep

    def _interrupted(self) -> bool:
        """Whether the request being served was interrupted (its client left, its time is up): the handler's chunks
        are then passed over without evaluation, and its completion ends at once without a token (it evaluates
        through the engine, which stops there), instead of the handler failing with an error."""
        scope = current_request.get()
        return scope is not None and scope.interrupted()

    def eval_text(self, tokens: np.ndarray) -> bool:
        """Serve the handler's ``llama.eval(tokens)`` for a text chunk; ``False``: not this request's next chunk (the
        flow is dropped and the caller serves the call as any other)."""
        flow = self.tokens
        end = self.cursor + len(tokens)
        if flow is None or end > len(flow) or not np.array_equal(flow[self.cursor : end], tokens):
            if flow is not None:
                self.disarm()
            return False
        if self._interrupted():
            self._set_host(end)
            return True
        self._prepared()
        target = min(end, len(flow) - 1)
        memory_end = self._memory_end()
        if target > memory_end:
            self._llama.n_tokens = memory_end
            self._process(flow[memory_end:target], len(flow))
        self._set_host(end)
        return True

    def eval_media(self, n_positions: int, decode: Callable[[int], int]) -> int | None:
        """Serve the handler's media chunk of ``n_positions`` at the current position: ``decode(n_past)`` decodes
        it there and returns the position after it. Returns that position, or ``None`` when the chunk is not this
        request's next one (the caller then decodes it as the host would)."""
        flow = self.tokens
        start, end = self.cursor, self.cursor + n_positions
        if flow is None or end > len(flow) or not bool((flow[start:end] < 0).all()):
            if flow is not None:
                self.disarm()
            return None
        if self._interrupted():
            self._set_host(end)
            return end
        self._prepared()
        if end > self._memory_end():
            # The cut before the request never falls inside a media chunk: the memory ends at this one's start.
            ids = flow[start:end]

            def fill() -> None:
                watched = self._watched
                if watched is not None:
                    # libmtmd decodes from C, unseen: what the positions and the context's logits held goes.
                    watched.unnamed(start)
                    watched.decoded(None)
                with engine_writes():
                    n_past = decode(start)
                if n_past != end:
                    raise ValueError(f"the media chunk filled positions {start}..{n_past}, not {start}..{end}")

            self._process_media(ids, fill, len(flow))
        self._set_host(end)
        return end

    def _set_host(self, end: int) -> None:
        flow = self.tokens
        assert flow is not None
        llama = self._llama
        llama.input_ids[self.cursor : end] = flow[self.cursor : end]
        llama.n_tokens = end
        self.cursor = end
