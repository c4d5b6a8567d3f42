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
        _config.env_impl.cache_clear()
        assert _config.env_impl() is want
    monkeypatch.setenv("MAGI_GROUP_COLLECTIVE_IMPL", "deepep")
    _config.env_impl.cache_clear()
    with pytest.raises(ValueError, match="MAGI_GROUP_COLLECTIVE_IMPL"):
        _config.env_impl()
    monkeypatch.setenv("MAGI_GROUP_COLLECTIVE_DEBUG", "1")
    _config.env_debug.cache_clear()
    assert _config.env_debug() is True
    monkeypatch.delenv("MAGI_GROUP_COLLECTIVE_IMPL")
    monkeypatch.delenv("MAGI_GROUP_COLLECTIVE_DEBUG")
    _config.env_impl.cache_clear()
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
