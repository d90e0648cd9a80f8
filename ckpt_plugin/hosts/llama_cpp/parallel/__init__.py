"""Parallel slots: N conversations over one context and one copy of the weights (``ckpt-serve --parallel N``).

- ``parallel_llama.py``: ``ParallelLlama``, the composition; ``slot_views.py``: the ``Llama`` view a request gets;
- ``slot_attachment.py``: the view's attachment, leasing a slot per generation; ``view_backend.py``: a slot's sequence
  as the engine's backend, evaluating through the scheduler;
- ``sequences.py``: a context's sequences as slots; ``slot_choice.py``: which slot a request leases;
- ``scheduler.py``: the batch scheduler's thread; ``lanes.py``: its per-context steps; ``submissions.py``: what a
  slot's thread submits, and what runs at its next step;
- ``kv_sharing.py``: cells shared between slots; ``slot_media.py``: media per slot; ``slot_drafts.py``: draft-model
  speculation per slot.

It may import the attachment room (a view is an attached ``Llama``), never the reverse.
"""

__all__: list[str] = []
