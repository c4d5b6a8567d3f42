"""magi_ffa_fa4."""

__all__: list[str] = []
