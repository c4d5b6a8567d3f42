"""Old module name of ``_launch_meta`` (benchmark scripts import it); everything is re-exported."""

from ._launch_meta import (
    CACHE_SIZE,
    ROW_PAD,
    LaunchMeta,
    Plan,
    build_launch_meta,
    build_plan,
    clear_launch_cache,
    clear_plan_cache,
    get_launch_meta,
    get_plan,
    r2p_enabled,
    tile_sizes,
)

__all__ = [
    "CACHE_SIZE",
    "ROW_PAD",
    "LaunchMeta",
    "Plan",
    "build_launch_meta",
    "build_plan",
    "clear_launch_cache",
    "clear_plan_cache",
    "get_launch_meta",
    "get_plan",
    "r2p_enabled",
    "tile_sizes",
]
