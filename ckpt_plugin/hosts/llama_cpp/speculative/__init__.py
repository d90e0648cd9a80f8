"""Speculative decoding on an attached ``Llama``: ``drafts.py`` (a draft model or prompt-lookup drafts, their state
kept with the target's checkpoints, ``enable_speculative``)."""

__all__: list[str] = []
