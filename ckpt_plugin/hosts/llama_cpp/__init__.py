"""llama-cpp-python behind one door: contexts, sequences, state copies and the patching of a ``Llama``."""

__all__: list[str] = []
