"""Old public names kept for one release: a module-level ``__getattr__`` (PEP 562) that returns the new object
and warns. Shared by magi_ffa and the kernel packages above it; each deprecated name is listed in
docs/migration.md with the release that removes it."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable

#: the release that removes the names deprecated now
REMOVED_IN = "0.2.0"


def deprecated_aliases(module: str, aliases: dict[str, str]) -> Callable[[str], object]:
    """The ``__getattr__`` of ``module`` (its ``__name__``) for ``aliases`` ``{old name: new name}``: reading
    ``module.old`` (``from module import old`` too) warns with a ``DeprecationWarning`` naming the new name
    and returns ``module.new``; any other missing name raises ``AttributeError`` as usual."""

    def __getattr__(name: str) -> object:
        new = aliases.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"`{module}.{name}` is deprecated and will be removed in {REMOVED_IN}: use `{module}.{new}`",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(sys.modules[module], new)

    return __getattr__
