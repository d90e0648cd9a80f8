"""What runs beside the engine through its public views: stats, slot files, publishing to the shared tier."""

__all__: list[str] = []
