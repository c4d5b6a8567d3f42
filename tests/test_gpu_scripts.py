"""The GPU suite's scripts run end to end on CPU ranks (gloo stands in for NCCL), so they cannot rot
between GPU sessions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_group_collective_check_runs_over_gloo() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "benchmarks" / "gpu_group_collective_check.py"), "--device", "cpu", "--seeds", "3"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "0 failures" in res.stdout
    assert "reduce lse == reference" in res.stdout
