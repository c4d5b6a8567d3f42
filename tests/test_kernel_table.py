"""The shipped auto table is what `kernel_backends_bench.py --write-table` makes of the committed measurements
(so its features are the ones the runtime computes, and nobody edits it by hand)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "ffa_results"
# the measurements the H200 table was written from (docs/benchmarks/kernel_backends.md)
H200_SOURCES = ["2026-12-02_h200_auto_d128.json", "2026-12-02_h200_kernel_backends_d256.json"]
H200_SIM_SOURCES = {"fa4": "2026-12-02_h200_sim_fa4.json", "cudnn": "2026-12-02_h200_sim_cudnn.json"}


def test_h200_table_is_rebuilt_from_its_measurements(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("torch")
    monkeypatch.setenv("MAGI_BENCH_DEVICE", "cpu")
    import kernel_backends_bench

    shipped = json.loads((ROOT / "packages/solver/src/magi_solver/kernel_tables/h200.json").read_text())
    rebuilt = kernel_backends_bench.write_table(
        str(tmp_path / "h200.json"),
        ",".join(str(RESULTS / name) for name in H200_SOURCES),
        ",".join(f"{backend}={RESULTS / name}" for backend, name in H200_SIM_SOURCES.items()),
    )
    assert rebuilt == shipped
    masks = {row["mask"] for row in shipped["rows"]}
    assert {"varlen_causal cp 8", "varlen_full cp 8"} <= masks  # simulated cp rows with both backends
