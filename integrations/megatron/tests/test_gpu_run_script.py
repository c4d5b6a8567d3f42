"""benchmarks/integration_runs/megatron_run.py, the GPU run of this integration, on a CPU (gloo, float64, a toy
model): it trains with magi-attention and with the framework's own attention and finds them equal, so the
script cannot rot between GPU sessions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "integration_runs" / "megatron_run.py"


def test_gpu_run_script_passes_on_cpu(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    out = tmp_path / "megatron.json"
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["passed"], res.stdout[-3000:]
    for run in report["runs"]:
        assert run["dtype"] == "float64" and run["kernel_backend"] == "torch", run
        assert len(run["losses_magi"]) == 5 and run["losses_magi"][-1] < run["losses_magi"][0], run[
            "losses_magi"
        ]
