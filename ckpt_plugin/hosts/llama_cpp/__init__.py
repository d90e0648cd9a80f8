"""llama-cpp-python behind one door: contexts, sequences, state copies and the patching of a ``Llama``.

Its rooms, each importing only those below it (pyproject.toml, ``[tool.importlinter]``, "hosts.llama_cpp rooms"):

- :mod:`~ckpt_plugin.hosts.llama_cpp.serving`: what a server built on the package needs besides the adapter (chat
  formats, the default model, model sizes, a plain ``Llama``, the demo);
- :mod:`~ckpt_plugin.hosts.llama_cpp.parallel`: N slots over one context (``ParallelLlama``), batched decoding;
- :mod:`~ckpt_plugin.hosts.llama_cpp.speculative`: speculative decoding with a draft model or prompt lookup;
- :mod:`~ckpt_plugin.hosts.llama_cpp.attachment`: an engine attached to one ``Llama`` (its patched methods);
- :mod:`~ckpt_plugin.hosts.llama_cpp.seam`: the calls into llama.cpp and llama-cpp-python's private attributes.
"""

__all__: list[str] = []
