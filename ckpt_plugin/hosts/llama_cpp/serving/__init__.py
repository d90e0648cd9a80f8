"""What a server built on the package needs besides the adapter itself (the server integration, the demo, the
benchmarks):

- ``chat_formats.py``: the chat formats ckpt-serve registers; ``default_model.py``: the embedded default model;
- ``model_sizes.py``: the least bytes of one cache entry, from a model's metadata;
- ``plain_llama.py``: a plain ``Llama`` opened, and the tokens one not attached evaluates; ``demo.py``: the demo.
"""

__all__: list[str] = []
