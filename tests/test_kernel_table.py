"""The shipped auto table is what `kernel_backends_bench.py --write-table` makes of the committed measurements
(so its features are the ones the runtime computes, and nobody edits it by hand)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# the measurements the H200 table was written from (docs/benchmarks/kernel_backends.md)
H200_SOURCES = [
    "2026-12-02_h200_auto_d128.json",
    "2026-12-02_h200_kernel_backends_d256.json",
    "2026-12-03_h200_deterministic_d128_dq_order.json",  # kernel_backends_bench.py --deterministic --sim-cp 8
]
H200_SIM_SOURCES = {"fa4": "2026-12-02_h200_sim_fa4.json", "cudnn": "2026-12-02_h200_sim_cudnn.json"}


def test_h200_table_is_rebuilt_from_its_measurements(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("torch")
    monkeypatch.setenv("MAGI_BENCH_DEVICE", "cpu")
    from benchmarks import kernel_backends_bench

    shipped = json.loads((ROOT / "packages/solver/src/magi_solver/kernel_tables/h200.json").read_text())
    rebuilt = kernel_backends_bench.write_table(
        str(tmp_path / "h200.json"),
        ",".join(str(RESULTS / name) for name in H200_SOURCES),
        ",".join(f"{backend}={RESULTS / name}" for backend, name in H200_SIM_SOURCES.items()),
    )
    assert rebuilt == shipped
    masks = {row["mask"] for row in shipped["rows"]}
    assert {"varlen_causal cp 8", "varlen_full cp 8"} <= masks  # simulated cp rows with both backends
    det = [row for row in shipped["rows"] if row.get("deterministic")]
    assert {"varlen_causal cp 8", "random"} <= {row["mask"] for row in det}  # deterministic-mode rows


def test_deterministic_rows_are_added_from_a_deterministic_run(tmp_path: Path, monkeypatch) -> None:
    """`--deterministic` rows (launch_<backend>_det) become the table's deterministic rows beside the shipped
    ones; the run's default-mode launch_* rows stay out; `render` gives the ratios."""
    pytest.importorskip("torch")
    monkeypatch.setenv("MAGI_BENCH_DEVICE", "cpu")
    from benchmarks import kernel_backends_bench as kb
    from magi_solver.kernel_choice import KernelTable, MaskFeatures, pick_kernel

    env = {"date": "2026-12-03", "gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "git": "x"}
    rows = []
    for kernel, fwd, bwd in (("launch_fa4", 1.0, 2.0), ("launch_fa4_det", 1.0, 6.0), ("launch_cudnn", 1.2, 2.4),
                             ("launch_cudnn_det", 1.2, 2.6), ("auto", 1.0, 2.0), ("auto_det", 1.2, 2.6)):  # fmt: skip
        rows.append(dict(kernel=kernel, mask="varlen_causal", S=8192, hq=64, hk=8, d=128, area=1,
                         fwd_ms=fwd, bwd_ms=bwd, fwd_spread=0.0, bwd_spread=0.0))  # fmt: skip
    rows.append(
        dict(kernel="launch_fa4_det", mask="random", S=8192, hq=64, hk=8, d=128, area=1, error="refused")
    )
    run = tmp_path / "det.json"
    run.write_text(json.dumps({"env": env, "rows": rows}))
    shipped = ROOT / "packages/solver/src/magi_solver/kernel_tables/h200.json"
    table = kb.write_table(str(tmp_path / "h200.json"), str(run), "", str(shipped))
    det = [r for r in table["rows"] if r.get("deterministic") and r["source"] == "det.json"]
    assert len(det) == 1 and det[0]["ms"] == {"fa4": [1.0, 6.0], "cudnn": [1.2, 2.6]}, det
    before = json.loads(shipped.read_text())["rows"]
    assert len(table["rows"]) == len(before) + (0 if any(r.get("deterministic") and r["mask"] == "varlen_causal"
                                                         and r["tokens"] == 8192 for r in before) else 1)  # fmt: skip
    loaded = KernelTable.from_dict(table)
    f = MaskFeatures(8192, 1, det[0]["tile_fill"], det[0]["slices_per_row"], det[0]["documents"])
    assert pick_kernel(loaded, f, 128, ["fa4", "cudnn"], deterministic=True).backward == "cudnn"
    text = kb.render({"env": env, "rows": rows})
    assert "2.00 -> 6.00 (3.00x)" in text and "refused" not in text.split("random")[0], text
