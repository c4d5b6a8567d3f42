"""Public API contract, configuration and table checks that need no process group."""

from __future__ import annotations

import inspect

import pytest

import magi_group_collective as gc
from magi_group_collective import _config
from magi_group_collective._tables import CastTables, ReduceTables, cross_check


def test_signatures_are_the_contract() -> None:
    cast = list(inspect.signature(gc.group_cast).parameters)
    assert cast == ["input", "output", "input_split_sizes", "output_split_sizes", "dst_indices", "src_index",
                    "group", "async_op"]  # fmt: skip
    red = list(inspect.signature(gc.group_reduce).parameters)
    assert red == ["input", "output", "input_split_sizes", "output_split_sizes", "dst_index", "src_indices",
                   "group", "async_op", "reduce_op", "input_lse", "output_lse", "deterministic"]  # fmt: skip
    for cls, first in ((gc.GroupCastPlan, "dst_indices"), (gc.GroupReducePlan, "dst_index")):
        params = inspect.signature(cls).parameters
        assert list(params)[2] == first
        for kw in ("group", "device", "impl"):
            assert params[kw].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize("fn", [gc.group_cast, gc.group_reduce, gc.GroupCastPlan, gc.GroupReducePlan,
                                gc.GroupReducePlan.reduce, gc.GroupCastPlan.cast], ids=lambda f: f.__qualname__)  # fmt: skip
def test_docstrings_name_every_parameter(fn) -> None:
    doc = inspect.getdoc(fn) or ""
    for name in inspect.signature(fn).parameters:
        if name in ("self",) or name.startswith("_"):
            continue
        assert name in doc, f"{fn.__qualname__}: parameter `{name}` is not documented"


def test_enums_and_env(monkeypatch) -> None:
    assert [m.value for m in gc.GroupCollectiveImpl] == ["a2av", "hierarchical", "native"]
    assert gc.GroupCollectiveImpl("a2av") == "a2av"
    assert _config.parse_impl("HIERARCHICAL") is gc.GroupCollectiveImpl.HIERARCHICAL
    assert _config.parse_reduce_op("Avg") is gc.ReduceOp.AVG
    with pytest.raises(ValueError, match="reduce_op"):
        _config.parse_reduce_op("max")
    for value, want in (("hierarchical", gc.GroupCollectiveImpl.HIERARCHICAL), ("", None)):
        monkeypatch.setenv("MAGI_GROUP_COLLECTIVE_IMPL", value)
        assert _config.env_impl() is want
    monkeypatch.setenv("MAGI_GROUP_COLLECTIVE_IMPL", "deepep")
    with pytest.raises(ValueError, match="MAGI_GROUP_COLLECTIVE_IMPL"):
        _config.env_impl()
    monkeypatch.setenv("MAGI_GROUP_COLLECTIVE_DEBUG", "1")
    _config.env_debug.cache_clear()
    assert _config.env_debug() is True
    monkeypatch.delenv("MAGI_GROUP_COLLECTIVE_IMPL")
    monkeypatch.delenv("MAGI_GROUP_COLLECTIVE_DEBUG")
    _config.env_debug.cache_clear()


def test_tables_transpose_and_cross_check() -> None:
    # rank 0 sends piece 0 (2 tokens) to ranks 0 and 1, piece 1 (1 token) to nobody
    r0 = CastTables.build([2, 1], [2], [[0, 1], []], [0], 2)
    r1 = CastTables.build([], [2], [], [0], 2)
    assert cross_check([r0, r1]) == []
    assert r0.transpose().transpose() == r0
    assert isinstance(r0.transpose(), ReduceTables)
    assert cross_check([r0.transpose(), r1.transpose()]) == []
    bad = CastTables.build([], [3], [], [0], 2)
    problems = cross_check([r0, bad])
    assert len(problems) == 1 and "(sender 0, receiver 1)" in problems[0] and "[2]" in problems[0]
    assert "different collectives" in cross_check([r0, r1.transpose()])[0]


def test_no_process_group_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        gc.GroupCastPlan([1], [1], [[0]], [0])


_NATIVE, _HIER, _A2AV = (
    gc.GroupCollectiveImpl.NATIVE,
    gc.GroupCollectiveImpl.HIERARCHICAL,
    gc.GroupCollectiveImpl.A2AV,
)
_FORBID = "DistAttnConfig.grpcoll_config.native=False"


@pytest.mark.parametrize(
    ("settings", "mesh", "want", "setting"),
    [
        # 1. configuration beats every variable
        (dict(configured="a2av", native_env=True, hierarchical_env=True, package_env=_NATIVE), True, _A2AV, "impl"),
        (dict(configured=_NATIVE, configured_by="cfg", package_env=_A2AV), False, _NATIVE, "cfg"),
        # 2. the runtime's native variable beats the mesh variable and the package's
        (dict(native_env=True, hierarchical_env=True, package_env=_A2AV), True, _NATIVE,
         "MAGI_ATTENTION_NATIVE_GRPCOLL=1"),
        (dict(native_env=True, native_forbidden_by=_FORBID), False, _A2AV, _FORBID),
        # 3. the runtime's hierarchical variable decides on a 2-D mesh only, before the package's
        (dict(hierarchical_env=False, package_env=_HIER), True, _A2AV, "MAGI_ATTENTION_HIERARCHICAL_COMM=0"),
        (dict(hierarchical_env=True, package_env=_A2AV), False, _A2AV, "MAGI_GROUP_COLLECTIVE_IMPL=a2av"),
        # 4. the package's variable, unless it asks for a forbidden native
        (dict(package_env=_NATIVE), True, _NATIVE, "MAGI_GROUP_COLLECTIVE_IMPL=native"),
        (dict(package_env=_NATIVE, native_forbidden_by=_FORBID), True, _HIER, _FORBID),
        # 5. the group's default
        (dict(), True, _HIER, "the 2-D mesh's default"),
        (dict(), False, _A2AV, "the flat group's default"),
    ],
)  # fmt: skip
def test_decide_impl_order(settings, mesh, want, setting) -> None:
    """The one precedence of `decide_impl` (docs/packages/group_collective.md, "Choosing the implementation")."""
    assert gc.decide_impl(gc.ImplSettings(**settings), mesh) == gc.ImplChoice(want, setting)


def test_decide_impl_checks_capability() -> None:
    with pytest.raises(
        ValueError, match=r"selected by MAGI_GROUP_COLLECTIVE_IMPL=hierarchical.*2-D DeviceMesh"
    ):
        gc.decide_impl(gc.ImplSettings(package_env=_HIER), False)
    with pytest.raises(ValueError, match="forbids it"):
        gc.decide_impl(gc.ImplSettings(configured="native", native_forbidden_by=_FORBID), False)
    with pytest.raises(ValueError, match="`impl` must be one of"):
        gc.decide_impl(gc.ImplSettings(configured="deepep"), False)


def test_clear_plan_cache_is_a_deprecated_alias() -> None:
    # the old name, for one release (docs/migration.md): three packages had a `clear_plan_cache`
    with pytest.warns(
        DeprecationWarning,
        match=r"removed in 0\.2\.0: use `magi_group_collective\.clear_collective_plan_cache`",
    ):
        old = gc.clear_plan_cache
    assert old is gc.clear_collective_plan_cache
    assert "clear_plan_cache" not in gc.__all__
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = gc.no_such_name
