"""The types every layer shares: checkpoints and their buffers, cache entries, errors, settings, counters, the
request scope, media keys and the protocols through which services and hooks see the engine."""
