"""The group-collective implementation of a key's GroupCast / GroupReduce plans, chosen here once per key.

One precedence, the first setting that says wins (configuration over environment; the table is in
docs/packages/group_collective.md, "Choosing the implementation"):

1. ``GrpCollConfig.native`` (True: native; False: not native, whatever the environment says);
2. ``MAGI_ATTENTION_NATIVE_GRPCOLL=1`` (when ``native`` is None): native;
3. on a 2-D (inter, intra) mesh, ``MAGI_ATTENTION_HIERARCHICAL_COMM`` (default true): hierarchical, else a2av;
4. on a flat group, ``MAGI_GROUP_COLLECTIVE_IMPL`` (when ``native`` is None), else a2av.

The choice is made when the key is built (a key made after dispatch keeps its dispatch key's choice), is
part of the key (`magi_attention.key.CollectiveChoice`, defined with the key, which sits below the runtime),
and so is compared across ranks by the key agreement before any plan exists: ranks that chose differently
would enter different collectives and hang. The plans get it as their ``impl=``, so
magi_group_collective's own fallback never decides for the runtime.
"""

from __future__ import annotations

from magi_group_collective import GroupCollectiveImpl
from magi_group_collective import env as grpcoll_env

from ..config import GrpCollConfig
from ..env import hierarchical_comm, native_grpcoll
from ..key import CollectiveChoice


def choose_collective(config: GrpCollConfig, two_level_mesh: bool) -> CollectiveChoice:
    """The implementation of a key's plans from its `GrpCollConfig`, the environment and the group's shape
    (``two_level_mesh``: a 2-D (inter, intra) DeviceMesh), by the precedence of the module docstring."""
    native = config.native
    if native:
        return _native("DistAttnConfig.grpcoll_config.native=True")
    if native is None and native_grpcoll():
        return _native("MAGI_ATTENTION_NATIVE_GRPCOLL=1")
    if two_level_mesh:
        hierarchical = hierarchical_comm()
        impl = GroupCollectiveImpl.HIERARCHICAL if hierarchical else GroupCollectiveImpl.A2AV
        return CollectiveChoice(impl, f"MAGI_ATTENTION_HIERARCHICAL_COMM={int(hierarchical)}")
    if native is False:
        return CollectiveChoice(GroupCollectiveImpl.A2AV, "DistAttnConfig.grpcoll_config.native=False")
    package_impl = grpcoll_env.impl()
    if package_impl is None:
        return CollectiveChoice(GroupCollectiveImpl.A2AV, "the flat group's default")
    if package_impl == GroupCollectiveImpl.NATIVE:
        return _native(f"MAGI_GROUP_COLLECTIVE_IMPL={package_impl}")
    return CollectiveChoice(GroupCollectiveImpl(package_impl), f"MAGI_GROUP_COLLECTIVE_IMPL={package_impl}")


def _native(setting: str) -> CollectiveChoice:
    return CollectiveChoice(GroupCollectiveImpl.NATIVE, setting, grpcoll_env.native_buffer_mb())
