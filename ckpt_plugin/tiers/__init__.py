"""Where states are kept: the tier protocol, the radix index, the RAM prompt cache, the disk tier, the store over
them and the registry that shares them; ``tiers.shared`` is the Redis/Valkey tier."""

__all__: list[str] = []
