"""Every environment variable magi_solver reads, in one place (the library never writes them).

- ``COLUMNS`` (the shell's): the terminal width `magi-attention-plan` lays its tables out for when its output
  is not a terminal.
"""

from __future__ import annotations

import os

__all__ = ["columns_set"]


def columns_set() -> bool:
    """True when ``COLUMNS`` holds a number (rich then takes the width from it)."""
    return os.environ.get("COLUMNS", "").strip().isdigit()
