"""Host adapters: the code that knows one host library (llama-cpp-python) and nothing above the engine."""

__all__: list[str] = []
