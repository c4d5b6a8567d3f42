"""The implementation of a plan's GroupCast / GroupReduce, chosen in this one module above the three
implementations (`_a2av`, `_hierarchical`, `_native`; none of them imports another or this one).

One precedence, the first that says wins: the plan's ``impl`` argument (the caller's configuration; the
attention runtime passes its own choice here), then ``MAGI_GROUP_COLLECTIVE_IMPL`` (read once per process),
then the group: hierarchical on a 2-D DeviceMesh, a2av on a flat group. docs/packages/group_collective.md,
"Choosing the implementation", has the table with the runtime's settings on top.
"""

from __future__ import annotations

from ._comm import Comm
from ._config import GroupCollectiveImpl, env_impl, parse_impl
from ._impl import CollectiveImpl


def choose_impl(impl: object, comm: Comm) -> GroupCollectiveImpl:
    """The implementation of a plan on ``comm``: ``impl`` (enum or string) if given, else the environment,
    else the group's default; ValueError for hierarchical on a flat group."""
    chosen = parse_impl(impl) if impl is not None else env_impl()
    if chosen is None:
        chosen = GroupCollectiveImpl.HIERARCHICAL if comm.mesh_shape is not None else GroupCollectiveImpl.A2AV
    if chosen is GroupCollectiveImpl.HIERARCHICAL and comm.mesh_shape is None:
        raise ValueError(
            "impl 'hierarchical' needs `group` to be a 2-D DeviceMesh (inter, intra); got a flat group. "
            "Pass a 2-D mesh or impl='a2av' (MAGI_GROUP_COLLECTIVE_IMPL may have selected it)."
        )
    return chosen


def selected_by(impl: object) -> str:
    """The setting that chose the implementation of a plan, for error messages."""
    if impl is not None:
        return f"impl={str(impl.value if isinstance(impl, GroupCollectiveImpl) else impl)!r}"
    return "MAGI_GROUP_COLLECTIVE_IMPL"


def implementation(impl: GroupCollectiveImpl) -> CollectiveImpl:
    """The implementation object of ``impl`` (hierarchical and native are imported on first use)."""
    if impl is GroupCollectiveImpl.HIERARCHICAL:
        from ._hierarchical import HierarchicalImpl

        return HierarchicalImpl()
    if impl is GroupCollectiveImpl.NATIVE:
        from ._native import NativeImpl

        return NativeImpl()
    from ._a2av import A2AVImpl

    return A2AVImpl()
