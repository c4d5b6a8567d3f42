"""The strict parsers of every package's environment variables (booleans, positive ints), in one place.

Each package's ``env`` module stays the one place that reads its variables; it hands the raw value here.
"""

from __future__ import annotations

__all__ = ["parse_bool", "parse_positive_int"]

_TRUE, _FALSE = ("1", "true"), ("0", "false")


def parse_bool(name: str, raw: str | None, default: bool) -> bool:
    """The boolean of variable ``name`` whose value is ``raw``: ``0`` / ``1`` / ``true`` / ``false`` in any
    case (surrounding blanks ignored); None or empty gives ``default``; anything else raises ``ValueError``
    naming the variable (a typo never silently turns a flag off)."""
    value = (raw or "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean: use 0, 1, true or false (any case)")


def parse_positive_int(name: str, raw: str | None, default: int, *, minimum: int = 1) -> int:
    """The integer of variable ``name`` whose value is ``raw`` (surrounding blanks ignored); None or empty
    gives ``default``; anything that is not an integer ``>= minimum`` raises ``ValueError`` naming the
    variable, its value and the default (a typo never silently falls back)."""
    value = (raw or "").strip()
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < minimum:
        want = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name}={raw!r} is not valid: it must be {want} (default {default})")
    return number
