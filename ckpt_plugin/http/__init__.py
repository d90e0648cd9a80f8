"""The ASGI layer: middleware, routes, request checks and guards, the admission queue, tenants, usage, metrics."""

__all__: list[str] = []
