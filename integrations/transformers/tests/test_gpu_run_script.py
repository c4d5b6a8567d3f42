"""benchmarks/integration_runs/hf_run.py, the GPU run of this integration, on a CPU (gloo, float64, a toy
model, the torch kernel): magi-attention and the framework's own attention train alike and the loss falls
(the script's own checks), so the script cannot rot between GPU sessions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CASE = "hf"  # `python -m benchmarks hf`, from the repository root


def test_gpu_run_script_passes_on_cpu() -> None:
    pytest.importorskip("transformers")
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks", CASE, "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert res.returncode == 0 and "hf: PASS" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
