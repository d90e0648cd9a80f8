"""The shared tier on Redis or Valkey: the tier, its value format, the write-behind thread."""

__all__: list[str] = []
