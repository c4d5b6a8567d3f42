"""magi_ffa."""

__all__: list[str] = []
