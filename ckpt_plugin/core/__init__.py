"""The types every layer shares: checkpoints and their buffers, cache entries, errors, settings, counters, the
request scope, media keys, memory kinds, and a slot's data with the ``Backend`` protocol through which the engine
drives a host (the protocols through which services and plugins see the engine are ``plugins/view.py``'s)."""

__all__: list[str] = []
