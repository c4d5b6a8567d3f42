"""The implementation of a plan's GroupCast / GroupReduce, chosen in this one module above the three
implementations (`_a2av`, `_hierarchical`, `_native`; none of them imports another or this one).

:func:`decide_impl` is the one rule, a pure function of the settings (read once, by whoever builds the
plan: a plan's constructor, or the attention runtime when it builds a key) and of the group's shape. One
precedence, the first setting that says wins:

1. the caller's configuration: a plan's ``impl`` argument (the attention runtime passes its own choice
   here, or ``GrpCollConfig.native=True``); ``GrpCollConfig.native=False`` only forbids native;
2. ``MAGI_ATTENTION_NATIVE_GRPCOLL=1`` (the runtime's): native;
3. on a 2-D DeviceMesh, ``MAGI_ATTENTION_HIERARCHICAL_COMM`` (the runtime's, default true): hierarchical,
   else a2av;
4. ``MAGI_GROUP_COLLECTIVE_IMPL`` (this package's);
5. the group: hierarchical on a 2-D DeviceMesh, a2av on a flat group.

Then the capability check: hierarchical needs a 2-D mesh (ValueError naming the setting that chose it).
docs/packages/group_collective.md, "Choosing the implementation", has the table.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._comm import Comm
from ._config import GroupCollectiveImpl, env_impl, parse_impl
from ._impl import CollectiveImpl

__all__ = ["ImplChoice", "ImplSettings", "choose_impl", "decide_impl", "implementation"]


@dataclass(frozen=True, slots=True)
class ImplSettings:
    """Every setting that may choose a plan's implementation, as read once by whoever builds the plan (None:
    the setting says nothing). Built by :func:`choose_impl` for a plan of this package alone, and by the
    attention runtime (``magi_attention._runtime.collective_choice``) when it builds a key."""

    configured: GroupCollectiveImpl | str | None = None
    """The caller's configuration (a plan's ``impl=``; the runtime's ``GrpCollConfig.native=True``)."""
    configured_by: str = "impl"
    """How errors name ``configured`` (e.g. ``DistAttnConfig.grpcoll_config.native=True``)."""
    native_forbidden_by: str | None = None
    """The configuration that forbids native (``GrpCollConfig.native=False``), None when allowed."""
    native_env: bool | None = None
    """``MAGI_ATTENTION_NATIVE_GRPCOLL`` (the runtime's): True selects native."""
    hierarchical_env: bool | None = None
    """``MAGI_ATTENTION_HIERARCHICAL_COMM`` (the runtime's): on a 2-D mesh, hierarchical (True) or a2av."""
    package_env: GroupCollectiveImpl | None = None
    """``MAGI_GROUP_COLLECTIVE_IMPL``."""


@dataclass(frozen=True, slots=True)
class ImplChoice:
    """The implementation of a plan and the setting that chose it, as errors name it."""

    impl: GroupCollectiveImpl
    setting: str


def decide_impl(settings: ImplSettings, two_level_mesh: bool) -> ImplChoice:
    """The implementation chosen by ``settings`` for a group (``two_level_mesh``: a 2-D (inter, intra)
    DeviceMesh), by the precedence of the module docstring; ValueError for hierarchical on a flat group."""
    native_ok = settings.native_forbidden_by is None
    if settings.configured is not None:
        choice = ImplChoice(parse_impl(settings.configured), settings.configured_by)
    elif settings.native_env and native_ok:
        choice = ImplChoice(GroupCollectiveImpl.NATIVE, "MAGI_ATTENTION_NATIVE_GRPCOLL=1")
    elif two_level_mesh and settings.hierarchical_env is not None:
        hier = settings.hierarchical_env
        impl = GroupCollectiveImpl.HIERARCHICAL if hier else GroupCollectiveImpl.A2AV
        choice = ImplChoice(impl, f"MAGI_ATTENTION_HIERARCHICAL_COMM={int(hier)}")
    elif settings.package_env is not None and (
        native_ok or settings.package_env != GroupCollectiveImpl.NATIVE
    ):
        choice = ImplChoice(settings.package_env, f"MAGI_GROUP_COLLECTIVE_IMPL={settings.package_env.value}")
    elif two_level_mesh:
        choice = ImplChoice(
            GroupCollectiveImpl.HIERARCHICAL, settings.native_forbidden_by or "the 2-D mesh's default"
        )
    else:
        choice = ImplChoice(
            GroupCollectiveImpl.A2AV, settings.native_forbidden_by or "the flat group's default"
        )
    if choice.impl is GroupCollectiveImpl.HIERARCHICAL and not two_level_mesh:
        raise ValueError(
            f"impl 'hierarchical' (selected by {choice.setting}) needs `group` to be a 2-D DeviceMesh "
            "(inter, intra); got a flat group. Pass a 2-D mesh or choose a2av."
        )
    if choice.impl is GroupCollectiveImpl.NATIVE and not native_ok:
        raise ValueError(f"{choice.setting} selects native, but {settings.native_forbidden_by} forbids it")
    return choice


def choose_impl(impl: object, comm: Comm) -> ImplChoice:
    """The implementation of a plan of this package on ``comm``: ``impl`` (enum or string) if given, else
    ``MAGI_GROUP_COLLECTIVE_IMPL`` (read now, when the plan is built), else the group's default."""
    if impl is None:
        settings = ImplSettings(package_env=env_impl())
    else:
        label = impl.value if isinstance(impl, GroupCollectiveImpl) else impl
        settings = ImplSettings(configured=impl, configured_by=f"impl={str(label)!r}")
    return decide_impl(settings, comm.mesh_shape is not None)


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
