"""magi_attention."""

__all__: list[str] = []
