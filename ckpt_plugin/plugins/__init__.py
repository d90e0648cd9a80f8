"""The pluggy hook specifications, how the engine calls them, and the engine's own behaviour as a plugin."""

__all__: list[str] = []
