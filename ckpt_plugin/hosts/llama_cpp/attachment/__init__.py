"""An engine attached to one ``llama_cpp.Llama``: its sequence 0 as the engine's one slot, and the patched methods.

- ``attach.py``: ``attach``, ``detach``, ``manager_of``; ``patches.py``: the ``Attachment`` (the patched methods);
- ``backend.py``: sequence 0 of a ``Llama`` as the engine's backend; ``logits.py``: which logits rows are kept;
- ``outside_writes.py``: llama.cpp writes made outside the engine, seen; ``outside_prompts.py``: a generation served
  over such writes; ``multimodal.py``: the relay of an MTMD chat handler's calls; ``media_flow.py``: its request's
  text and media chunks served by the engine;
- ``host_cache.py``: ``HostPromptCache`` and ``SharedLlamaState``; ``logprobs.py``, ``host_logprobs.py``: the
  logits a completion reads, and its logprobs, vectorized; ``guarded_sampling.py``: the guarded sampler chain
  (grammar dead ends, ``ignore_eos``, penalties).
"""

__all__: list[str] = []
