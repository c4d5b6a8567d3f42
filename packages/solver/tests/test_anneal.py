"""The annealing check of a placement (`magi_solver.tools.anneal`)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from magi_solver.documents_repair import _State
from magi_solver.tools.anneal import anneal, family_placement, main


def _case(name: str = "docs4k_causal", total: int = 8192, cp: int = 4, seed: int = 1):
    _, tables, owner = family_placement(name, total, cp, seed)
    return tables, owner


def _metric(owner: np.ndarray, tables) -> float:
    st = _State(owner.copy(), tables)
    return float(st.fwd.max() + st.bwd.max())


def test_from_a_poor_start_it_finds_a_lower_metric_and_keeps_chunk_counts():
    tables, owner = _case()
    cp = tables.cp
    contiguous = np.repeat(np.arange(cp), np.bincount(owner, minlength=cp))
    res = anneal(contiguous, tables, swaps=3000, seed=0)
    assert res.start_metric_ms == pytest.approx(_metric(contiguous, tables))
    assert res.best_metric_ms < res.start_metric_ms
    assert res.best_metric_ms == pytest.approx(_metric(res.best_owner, tables))  # repriced from scratch
    np.testing.assert_array_equal(
        np.bincount(res.best_owner, minlength=cp), np.bincount(contiguous, minlength=cp)
    )
    assert res.least_time_imbalance <= res.start_time_imbalance
    assert 0 < res.accepted <= res.swaps == 3000


def test_start_left_unchanged_deterministic_and_cold_walk_never_rises():
    tables, owner = _case(cp=3, seed=2)
    before = owner.copy()
    a = anneal(owner, tables, swaps=1500, temperature=0.0, seed=5)
    b = anneal(owner, tables, swaps=1500, temperature=0.0, seed=5)
    np.testing.assert_array_equal(owner, before)
    np.testing.assert_array_equal(a.best_owner, b.best_owner)
    assert a.best_metric_ms == b.best_metric_ms <= a.start_metric_ms
    assert a.start_metric_ms == pytest.approx(_metric(owner, tables))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"swaps": 0}, "swaps"), ({"swaps": 1.5}, "swaps"), ({"temperature": -1.0}, "temperature")],
)
def test_bad_arguments_name_themselves(kwargs, name):
    tables, owner = _case()
    with pytest.raises(ValueError, match=name):
        anneal(owner, tables, **kwargs)
    with pytest.raises(ValueError, match="owner"):
        anneal(owner[:-1], tables)


def test_cli_rows(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["--mask", "docs4k_full", "--tokens-per-gpu", "1024", "--cp", "4", "--swaps", "300",
                 "--json", str(out)]) == 0  # fmt: skip
    rows = json.loads(out.read_text())
    assert [r["start"] for r in rows] == ["plan", "contiguous"]
    plan = rows[0]
    assert plan["start_metric_ms"] == pytest.approx(plan["plan_metric_ms"])
    for r in rows:
        assert r["best_metric_ms"] <= r["start_metric_ms"]
    assert "best/plan" in capsys.readouterr().out
