"""`python -m benchmarks sim --scaling` on the CPU (torch path, toy sizes): the scaling table's
efficiency, the plan's remote K/V and the cost model's prediction for every simulated row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "degree, mask, algs",
    [
        (0, "video_block_causal", "default"),  # one merged call per rank
        (
            1,
            "docs4k_causal",
            "default,min_heap",
        ),  # the host call and a remote stage; two dispatches, a row each
    ],
)
def test_scaling_table_on_cpu(tmp_path: Path, degree: int, mask: str, algs: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MAGI_BENCH_DEVICE": "cpu"}
    args = ["--tokens-per-gpu", "64", "--cps", "2", "--masks", mask, "--degree", str(degree),
            "--no-cp1", "--single-max-tokens", "128", "--kernel-backend", "auto", "--single-backend", "torch",
            "--scaling", "--profile", str(tmp_path / "prof.txt"), "--dispatch-algs", algs,
            "--json", str(tmp_path / "s.json")]  # fmt: skip
    res = subprocess.run([sys.executable, "-m", "benchmarks", "sim", *args],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads((tmp_path / "s.json").read_text())["scaling"]
    assert [r["kernel_backend"] for r in rows] == ["auto"] * len(
        rows
    )  # the explicit backend: the yardstick only
    assert [r["dispatch_alg_asked"] for r in rows] == algs.split(",")
    for r in rows:
        assert r["E_fwd"] > 0 and r["E_bwd"] > 0  # auto takes the explicit backend's one-GPU rate
        assert r["E_fwd_queued"] > 0 and r["E_bwd_queued"] > 0  # the same ranks timed behind GPU work
        assert r["chunk_size"] >= 1 and r["remote_kv_tokens_max"] >= r["remote_kv_tokens_mean"] >= 0
        assert r["predicted"]["fwd_ms"] > 0 and r["predicted"]["bwd_tflops_per_gpu"] > 0
        assert set(r["timed_ranks"]) <= {0, 1} and r["timed_ranks"]
        if r["dispatch_alg_asked"] != "default":
            assert r["dispatch_alg"] == r["dispatch_alg_asked"]
    assert f"| {mask} | 2 | auto (torch) |" in res.stdout
    profile = (tmp_path / "prof.txt").read_text()  # the slowest rank's torch.profiler table, one per row
    assert profile.startswith(f"== {mask} cp 2 auto rank") and "aten::" in profile


def test_unknown_mask_or_dispatch_is_refused() -> None:
    """A mask name or dispatch algorithm the benchmark does not know fails before any work, naming the choices."""
    from benchmarks.common import make_mask
    from benchmarks.magi_attention_bench import dispatch_alg

    assert dispatch_alg("default") is None and dispatch_alg("affinity").value == "affinity"
    with pytest.raises(ValueError, match="min_heap"):
        dispatch_alg("no_such_alg")
    with pytest.raises(ValueError, match="docs4k_causal"):
        make_mask("varlen_docs", 1024)


def test_candidate_ranks_cover_the_slowest_of_each_way_and_the_plan_busiest() -> None:
    """`pick_ranks`: the quick round's slowest ranks forward and backward (separately), the plan's busiest rank
    by area and by remote K/V (ties: the lowest rank); a rank fast in the quick round and light in the plan is
    left out."""
    from benchmarks.magi_attention_bench import pick_ranks

    fwd = [1.0, 5.0, 2.0, 1.5, 1.1, 1.0, 4.0, 1.0]
    bwd = [2.0, 3.0, 9.0, 2.5, 2.0, 8.0, 2.0, 2.0]
    areas = [10, 10, 10, 10, 12, 10, 10, 10]
    remote = [0, 5, 5, 5, 5, 5, 5, 7]
    assert pick_ranks(fwd, bwd, areas, remote, top=2) == [1, 2, 4, 5, 6, 7]
    assert pick_ranks(fwd, bwd, areas, remote, top=1) == [1, 2, 4, 7]
    # a balanced plan (every rank alike): ties go to the lowest rank, so the area's and the K/V's coincide
    assert pick_ranks([1.0] * 4, [1.0] * 4, [3] * 4, [2] * 4, top=2) == [0, 1]


def test_quick_round_times_a_short_rank_twice() -> None:
    """A short step's first call builds its launch data: the quick round times a second call instead."""
    from benchmarks.magi_attention_bench import QUICK_REPEAT_MS, quick_step

    first_short = iter([(5.0, 40.0), (1.0, 3.0)])
    assert quick_step(lambda: next(first_short)) == (1.0, 3.0)
    long = iter([(QUICK_REPEAT_MS, 1.0), (1.0, 1.0)])
    assert quick_step(lambda: next(long)) == (QUICK_REPEAT_MS, 1.0)
