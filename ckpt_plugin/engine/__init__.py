"""The checkpoint engine: the manager, each slot's controller and memory, the captures."""

__all__: list[str] = []
