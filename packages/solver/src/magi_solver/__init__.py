"""magi_solver."""

__all__: list[str] = []
