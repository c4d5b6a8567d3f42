"""magi_group_collective: GroupCast (multicast all-to-all-v) and GroupReduce (its transpose).

See docs/packages/group_collective.md for the semantics and a picture.
"""

import warnings

from ._comm import as_device_mesh
from ._config import GroupCollectiveImpl, ReduceOp
from ._functional import clear_collective_plan_cache, group_cast, group_reduce
from ._plan import GroupCastPlan, GroupReducePlan
from ._select import ImplChoice, ImplSettings, decide_impl
from ._symmetric import NativeUnavailableError
from ._symmetric import release_buffers as release_native_buffers
from ._work import Work
from .agreement import AgreementError, ExchangeError

__version__ = "0.1.0"  # the [project] version of pyproject.toml (CI checks that they agree)

__all__ = [
    "AgreementError",
    "ExchangeError",
    "GroupCastPlan",
    "GroupCollectiveImpl",
    "GroupReducePlan",
    "ImplChoice",
    "ImplSettings",
    "NativeUnavailableError",
    "ReduceOp",
    "Work",
    "as_device_mesh",
    "clear_collective_plan_cache",
    "decide_impl",
    "group_cast",
    "group_reduce",
    "release_native_buffers",
]

# old names, for one release (docs/migration.md); {old: new}
_DEPRECATED = {"clear_plan_cache": "clear_collective_plan_cache"}


def __getattr__(name: str) -> object:
    if name not in _DEPRECATED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    new = _DEPRECATED[name]
    message = f"`{__name__}.{name}` is deprecated and will be removed in 0.2.0: use `{__name__}.{new}`"
    warnings.warn(message, DeprecationWarning, stacklevel=2)
    return globals()[new]
