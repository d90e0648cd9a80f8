"""The seam with llama-cpp-python: what only wraps its calls and attributes, and imports no other room.

- ``compat.py``: every access to llama-cpp-python's private attributes, with the version it was checked against;
- ``context.py``: a context's memory kind, fingerprint and logits, and the grammar guard's child-process checks.
"""

__all__: list[str] = []
