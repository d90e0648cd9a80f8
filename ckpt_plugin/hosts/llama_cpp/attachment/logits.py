"""Which logits a generation needs: computed by llama.cpp, and kept in the host's ``scores`` rows.

llama-cpp-python with ``logits_all=True`` (``llama_cpp.server``'s default) has llama.cpp compute the logits of every
prompt token and copies each row into an ``n_ctx x n_vocab`` array, although sampling reads only the last one (inside
llama.cpp). What a request really reads:

- sampling: the last token's logits, in llama.cpp (always computed: every batch's last token has them);
- completion logprobs (``logprobs`` in completions, ``logprobs``/``top_logprobs`` in chat): the host's ``scores`` rows
  from the last prompt token on, by absolute position;
- prompt logprobs (``echo`` with ``logprobs``): every row from position 0;
- a stopping criterion: the latest logits, where llama-cpp-python reads them for it: ``_scores[sample_idx -
  n_tokens]``, which is row 0 once the last evaluated position is sampled (the host alone hands over the first prompt
  token's row there; the plugin puts the latest logits in row 0, what ``logits_all=False`` gives, unless row 0 is a
  prompt row an ``echo`` reads), and with a draft model, whose batches sample several positions, also the rows of
  the generated positions;
- a draft model's verification: llama.cpp's logits of every position of a generated batch, no ``scores`` rows.

Pure: positions in, decisions out; :mod:`ckpt_plugin.hosts.llama_cpp.attachment.backend` applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EVERY_ROW", "LogitsNeeds", "NO_ROWS", "generation_needs", "max_keep"]


@dataclass(frozen=True, slots=True)
class LogitsNeeds:
    """The logits a generation reads.

    :ivar outputs_from: Positions from here on get logits computed (besides each batch's last token); ``None``: only
        the last tokens.
    :ivar rows_from: Positions from here on get their logits row written to the host's full-size ``scores`` array
        (by absolute position); ``None``: no rows.
    :ivar latest_row: The latest logits are also written to row 0, where a stopping criterion reads them (without
        other rows, a one-row array will do).
    """

    outputs_from: int | None = None
    rows_from: int | None = None
    latest_row: bool = False

    @property
    def full_rows(self) -> bool:
        """Whether a full-size ``scores`` array is needed."""
        return self.rows_from is not None

    def first_output(self, n_past: int, n_tokens: int) -> int:
        """Index in a batch of ``n_tokens`` starting at ``n_past`` of the first token that needs logits (the last
        token always does)."""
        if self.outputs_from is None:
            return n_tokens - 1
        return min(n_tokens - 1, max(0, self.outputs_from - n_past))


NO_ROWS = LogitsNeeds()
"""Sampling only: the fast path."""

EVERY_ROW = LogitsNeeds(outputs_from=0, rows_from=0)
"""What ``logits_all=True`` promises to a caller of ``Llama.eval`` outside a generation."""


def generation_needs(prompt_end: int, *, logprobs: bool, echo: bool, stopping_criteria: bool,
                     draft: bool) -> LogitsNeeds:
    """The logits a generation of a prompt ending at ``prompt_end`` reads (see the module's list)."""
    last_prompt = max(0, prompt_end - 1)
    rows: int | None = None
    if logprobs:
        rows = 0 if echo else last_prompt
    elif stopping_criteria and draft:
        rows = last_prompt
    outputs = rows
    if draft:
        outputs = last_prompt if outputs is None else min(outputs, last_prompt)
    # Row 0 is the criterion's unless an echo reads the prompt's own row 0.
    return LogitsNeeds(outputs, rows, stopping_criteria and (rows is None or rows > 0))


def max_keep(needs: LogitsNeeds, exact_rows: int) -> int | None:
    """Most prompt tokens a restore may keep so that every row the generation reads is exact.

    Rows ``[needs.rows_from, n_keep)`` are not evaluated again: they must be among the ``exact_rows`` leading rows
    known to hold this prompt's logits. ``None``: no limit.
    """
    if needs.rows_from is None:
        return None
    return max(exact_rows, needs.rows_from)
