"""`python -m benchmarks key-step`: a new key + dispatch per step on gloo ranks started with a tree's
packages on PYTHONPATH (this checkout only here: the baseline's run is the same launch on another tree)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_key_step_on_this_checkout(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "k.json"
    args = [
        "--tokens",
        "256,512",
        "--steps",
        "2",
        "--warmup",
        "0",
        "--rounds",
        "1",
        "--no-baseline",
        "--json",
        str(out),
    ]
    res = subprocess.run([sys.executable, "-m", "benchmarks", "key-step", *args],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["baseline"] is None and [r["tokens"] for r in result["rows"]] == [256, 512]
    for row in result["rows"]:
        s = row["this"]
        assert s["steps"] == 2 and 0 < s["min_ms"] <= s["median_ms"] <= s["max_ms"]
        assert "baseline" not in row and "ratio_this_over_baseline" not in row
    assert "this/baseline" not in res.stdout and "512" in res.stdout


def test_step_masks_are_new_packed_documents_each_step() -> None:
    from benchmarks.key_step_bench import step_masks

    masks = step_masks(4096, 3, seed=7)
    assert masks == step_masks(4096, 3, seed=7) and len({json.dumps(m) for m in masks}) == 3
    for q, k, t in masks:
        assert q == k and q[0][0] == 0 and q[-1][1] == 4096 and len(q) > 2 and set(t) == {1}
        assert all(a[1] == b[0] for a, b in itertools.pairwise(q))


def test_baseline_tree_is_the_commit_packages(tmp_path: Path) -> None:
    """The baseline's packages come from `git archive` of the commit; a missing commit is named."""
    from benchmarks.key_step_bench import BASELINE, tree_pythonpath, unpack_commit

    if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", BASELINE + "^{commit}"]).returncode:
        pytest.skip(f"this checkout does not hold {BASELINE}")
    tree = unpack_commit(BASELINE, tmp_path / "old")
    path = tree_pythonpath(tree).split(os.pathsep)
    assert str(tree / "packages" / "magi_attention" / "src") in path
    assert (tree / "packages" / "solver" / "src" / "magi_solver" / "__init__.py").exists()
    with pytest.raises(RuntimeError, match="no-baseline"):
        unpack_commit("0" * 40, tmp_path / "missing")
