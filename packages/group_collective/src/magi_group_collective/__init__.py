"""magi_group_collective."""

__all__: list[str] = []
