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


def test_native_check_needs_cuda_and_device_script_parses() -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_group_collective_check.py"), "--device", "cpu"]
    res = subprocess.run([*cmd, "--impl", "native"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "--impl native needs --device cuda" in res.stderr, res.stderr[-2000:]
    for script in (
        "native_grpcoll_device.sh",
        "gpu_suite.sh",
        "integrations_device.sh",
        "integration_wheels.sh",
    ):
        assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / script)]).returncode == 0, script


def test_bandwidth_tables_are_consistent() -> None:
    """The GPU bandwidth benchmark's tables: every rank's agree, half of each input is sent, nothing to self."""
    import group_collective_bench as bench  # benchmarks/ is on pytest.ini's pythonpath

    from magi_group_collective._tables import CastTables, cross_check

    for world in (2, 3, 4, 8):
        tables = [CastTables.build(*bench.bandwidth_tables(world, r, 4096), world) for r in range(world)]
        assert not cross_check(tables), world
        for r, t in enumerate(tables):
            sent = sum(n * len(d) for n, d in zip(t.input_split_sizes, t.dst_indices))
            assert sent * 2 == sum(t.input_split_sizes) and all(r not in d for d in t.dst_indices)
