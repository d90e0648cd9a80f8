"""An engine attached to one ``llama_cpp.Llama``: its sequence 0 as the engine's one slot, and the patched methods.

- ``attach.py``: ``attach``, ``detach``, ``manager_of``; ``patches.py``: the ``Attachment`` (the patched methods);
- ``backend.py``: sequence 0 of a ``Llama`` as the engine's backend; ``logits.py``: which logits rows are kept;
- ``outside_writes.py``: llama.cpp writes made outside the engine, seen; ``outside_prompts.py``: a generation served
  over such writes; ``multimodal.py``: media chunks of an MTMD chat handler;
- ``host_cache.py``: ``HostPromptCache`` and ``SharedLlamaState``; ``logprobs.py``, ``host_logprobs.py``: the
  completion logprobs, vectorized; ``guarded_sampling.py``: grammar dead ends, ``ignore_eos``, penalties.
"""

__all__: list[str] = []
