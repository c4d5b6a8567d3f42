"""The group-collective implementation of a key's GroupCast / GroupReduce plans, chosen here once per key.

The rule is magi_group_collective's one :func:`~magi_group_collective.decide_impl` (the precedence and the
capability check, the same for the runtime's plans and for a plan built alone; the table is in
docs/packages/group_collective.md, "Choosing the implementation"). This module only reads the settings,
once, when the key is built: ``GrpCollConfig.native`` (True: native; False: never native), then
``MAGI_ATTENTION_NATIVE_GRPCOLL``, ``MAGI_ATTENTION_HIERARCHICAL_COMM`` (2-D meshes) and
``MAGI_GROUP_COLLECTIVE_IMPL``.

The choice is part of the key (`magi_attention.key.CollectiveChoice`, defined with the key, which sits below
the runtime; a key made after dispatch keeps its dispatch key's choice), and so is compared across ranks by
the key agreement before any plan exists: ranks that chose differently would enter different collectives
and hang. The plans get it as their ``impl=``, so nothing is read again later.
"""

from __future__ import annotations

from magi_group_collective import GroupCollectiveImpl, ImplSettings, decide_impl
from magi_group_collective import env as grpcoll_env

from ..config import GrpCollConfig
from ..env import hierarchical_comm, native_grpcoll
from ..key import CollectiveChoice


def collective_settings(config: GrpCollConfig) -> ImplSettings:
    """The settings of a key's implementation, read now (when the key is built)."""
    native = config.native
    package_env = grpcoll_env.impl()
    return ImplSettings(
        configured=GroupCollectiveImpl.NATIVE if native else None,
        configured_by="DistAttnConfig.grpcoll_config.native=True",
        native_forbidden_by="DistAttnConfig.grpcoll_config.native=False" if native is False else None,
        native_env=native_grpcoll(),
        hierarchical_env=hierarchical_comm(),
        package_env=None if package_env is None else GroupCollectiveImpl(package_env),
    )


def choose_collective(config: GrpCollConfig, two_level_mesh: bool) -> CollectiveChoice:
    """The implementation of a key's plans from its `GrpCollConfig`, the environment (read now) and the
    group's shape (``two_level_mesh``: a 2-D (inter, intra) DeviceMesh); ValueError where the chosen
    implementation cannot fit the group's shape (hierarchical on a flat group)."""
    choice = decide_impl(collective_settings(config), two_level_mesh)
    buffer_mb = grpcoll_env.native_buffer_mb() if choice.impl is GroupCollectiveImpl.NATIVE else None
    return CollectiveChoice(choice.impl, choice.setting, buffer_mb)
